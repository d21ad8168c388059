"""Engine requests on behalf of one HTTP request: the first output is awaited before the
response starts (parameter errors become 400s, a full queue a 503; a client that leaves while
queued is aborted), several prompts' streams are merged, the request's deadline is enforced, and
every engine generator is closed when we stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Protocol, TypeVar

from starlette.types import Receive

from api.deadline import Deadline, until_deadline
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams

T = TypeVar("T")

# (prompt index, output): completions with several prompts interleave their outputs.
Outputs = AsyncIterator[tuple[int, RequestOutput]]


class Generator(Protocol):
    """The one engine method this module needs (engine/async_engine.py `AsyncEngine`)."""

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...


class ClientDisconnected(Exception):
    """The client closed the connection before the response started."""


async def wait_for_disconnect(receive: Receive) -> None:
    # NOTE: only call this once the body has been read: every message until then is body.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """`await work`, but cancel it (running its cleanup) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # Let the work's own `finally` (the engine abort) run before we answer.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def start_outputs(
    engine: Generator,
    prompts: list[list[int]],
    params: list[SamplingParams],
    request_id: str,
    receive: Receive,
    deadline: Deadline | None = None,
) -> Outputs:
    """Submit every prompt and wait for the first output; returns the whole stream.

    Raises what the engine raises before its first output (ParamError, EngineOverloadedError),
    the deadline's APIError, and ClientDisconnected; once the deadline passes, the stream raises
    it. The returned generator must be closed (SSEResponse does it)."""
    assert prompts and len(prompts) == len(params), "one SamplingParams per prompt"
    if deadline is not None:
        deadline.check()  # e.g. it passed while the prompt waited for the tokenizer
    if len(prompts) == 1:
        source = _single(engine.generate(prompts[0], params[0], request_id))
    else:
        source = _merged(engine, prompts, params, request_id)
    if deadline is not None:
        source = until_deadline(source, deadline)
    try:
        first = await unless_disconnected(anext(source), receive)
    except BaseException:
        await source.aclose()
        raise
    return _prepend(first, source)


async def _single(outputs: AsyncIterator[RequestOutput]) -> Outputs:
    async with aclosing(outputs):  # type: ignore[type-var]
        async for out in outputs:
            yield 0, out


async def _prepend(first: tuple[int, RequestOutput], rest: Outputs) -> Outputs:
    async with aclosing(rest):  # type: ignore[type-var]
        yield first
        async for item in rest:
            yield item


async def _merged(engine: Generator, prompts: list[list[int]], params: list[SamplingParams], request_id: str) -> Outputs:
    """One task per prompt feeding one queue, so outputs leave in the order they were made."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | Exception | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with aclosing(engine.generate(prompts[i], params[i], f"{request_id}-{i}")) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it in its own task
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
