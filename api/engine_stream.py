"""`EngineStream`: the engine outputs of one HTTP request, as (prompt index, output). Every
prompt's engine stream is pumped by a task of its own into one queue, so several prompts merge in
the order their outputs were made; each wait for the next output ends at the request's deadline
(api/transport/deadline.py); an output carrying an engine error is raised as `EngineFailed`, or as
`EngineLost` when the engine process holding the request was lost and a new one is starting."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing

from api.errors import RESTARTING_RETRY_AFTER_S, APIError
from api.transport.deadline import Deadline
from engine.front import RequestOutput

Item = tuple[int, RequestOutput]  # (prompt index, output)


class EngineFailed(APIError):
    """The engine ended the request with an error (a failed step, a dead engine)."""

    def __init__(self, reason: str) -> None:
        super().__init__(500, f"generation failed: {reason}", code="engine_error")
        self.reason = reason


class EngineLost(EngineFailed):
    """The engine process holding the request was lost after its first output, and a new one is
    starting: like a refusal before any output (api/errors.py `handle_engine_restarting`), a 503
    with Retry-After that the SDKs retry, not a 500. A stream whose 200 is sent gets it in-band."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.status = 503
        self.message = reason
        self.code = "engine_restarting"
        self.type = "unavailable_error"
        self.headers = {"Retry-After": str(RESTARTING_RETRY_AFTER_S)}


class EngineStream:
    """The engine outputs of one HTTP request as (prompt index, output): every prompt's stream
    merged in the order the outputs were made, until the request's deadline. One task per prompt
    pumps its engine stream into one queue; `aclose` cancels them, which aborts whatever has not
    finished (AsyncEngine's stream does it in its `finally`)."""

    def __init__(self, sources: list[AsyncIterator[RequestOutput]], deadline: Deadline | None) -> None:
        self._deadline = deadline
        self._queue: asyncio.Queue[Item | Exception | None] = asyncio.Queue()
        self._running = len(sources)
        self._held: deque[Item] = deque()
        self.first_output: RequestOutput | None = None  # the first output, once `first` has it
        self._tasks = [asyncio.create_task(self._pump(i, source)) for i, source in enumerate(sources)]

    async def _pump(self, index: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(source):  # type: ignore[type-var]
                async for out in source:
                    self._queue.put_nowait((index, out))
        except Exception as e:  # raised in the consumer's task, by next()
            self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(None)

    async def first(self) -> None:
        """Wait for the first output: raises what refused the request (EngineOverloadedError,
        the deadline's APIError); an output that carries an engine error is the stream's to raise."""
        item = await self._take()
        if item is not None:
            self._held.append(item)
            self.first_output = item[1]

    async def next(self) -> Item | None:
        """The next output, None at the end; EngineFailed for an output that carries an error."""
        item = self._held.popleft() if self._held else await self._take()
        if item is not None and item[1].error is not None:
            raise (EngineLost if item[1].restarting else EngineFailed)(item[1].error)
        return item

    async def _take(self) -> Item | None:
        while self._running:
            got = await (self._queue.get() if self._deadline is None else self._deadline.run(self._queue.get))
            if got is None:
                self._running -= 1
            elif isinstance(got, Exception):
                raise got
            else:
                return got
        return None

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
