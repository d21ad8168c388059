"""The pieces that keep a flood, a slow request or a shutdown from hurting anyone else, without a
server: the engine admits exactly up to its queue bounds (and an empty queue takes anything), the
one admission rule counts requests being tokenized and those in transit to the core, a deadline
ends an engine stream and closes it, and a drain waits for the last request or gives up at its
timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from api.engine_stream import EngineStream
from api.errors import APIError
from api.transport.deadline import Deadline, server_stopping_error
from api.transport.inflight import InFlight
from api.transport.metrics import ServerMetrics
from engine.config import EngineConfig
from engine.front.admission import Admission, EngineOverloadedError, QueueLimits
from engine.front.async_engine import AsyncEngine
from engine.front.outputs import RequestOutput
from scheduler.output import SchedulerStats
from scheduler.request import SamplingParams

MAX_TOKENS = 3


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def outcome(engine: AsyncEngine, request_id: str, prompt: list[int], p: SamplingParams) -> Any:
    """The number of tokens each sample got, or the EngineOverloadedError that refused it."""
    tokens = [0] * p.n
    try:
        async for out in engine.generate(prompt, p, request_id):
            tokens[out.index] += len(out.new_token_ids)
    except EngineOverloadedError as e:
        return e
    return tokens


def arrive_together(
    path: Path, limits: QueueLimits, requests: list[tuple[list[int], SamplingParams]], max_num_seqs: int = 1
) -> list[Any]:
    """All requests reach an idle engine in one event-loop tick, before it schedules a step."""

    async def main() -> list[Any]:
        # In-process: the queue is counted in the front either way (tests/engine/test_engine_proc.py covers
        # the engine process), and a process per case would cost seconds each.
        engine = AsyncEngine.from_config(
            EngineConfig(
                model=str(path),
                dtype="float32",
                kv_cache_memory="8MiB",
                max_num_seqs=max_num_seqs,
                engine_process=False,
            )
        )
        await engine.start(limits)
        try:
            results = await asyncio.gather(
                *(outcome(engine, f"r{i}", prompt, p) for i, (prompt, p) in enumerate(requests))
            )
            later = await outcome(engine, "later", requests[0][0], requests[0][1])  # the queue has drained
            assert engine.stats().num_kv_pages_used == 0
            return [*results, later]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def refused(result: Any) -> bool:
    return isinstance(result, EngineOverloadedError)


@pytest.mark.parametrize(("max_num_seqs", "bound"), [(1, 1), (2, 2), (2, 4), (4, 1)])
def test_engine_admits_the_free_batch_slots_plus_exactly_max_queued_requests(
    qwen3_ckpt: Path,
    max_num_seqs: int,
    bound: int,
) -> None:
    admitted = max_num_seqs + bound
    results = arrive_together(
        qwen3_ckpt, QueueLimits(max_queued_requests=bound), [([5, 6, 7], params())] * 8, max_num_seqs
    )
    assert results[:admitted] == [[MAX_TOKENS]] * admitted  # admitted ones finish whole
    assert all(refused(r) for r in results[admitted:8])
    assert f"{bound} requests are already waiting for a batch slot (limit {bound})" in str(results[admitted])
    assert results[8] == [MAX_TOKENS]


def test_each_of_n_samples_counts_against_the_request_bound(qwen3_ckpt: Path) -> None:
    # One slot: the first request's second sample is the one queued; 1 + 2 > 2, then 1 + 1 fits.
    results = arrive_together(
        qwen3_ckpt,
        QueueLimits(max_queued_requests=2),
        [([5, 6], params(n=2)), ([5, 6], params(n=2)), ([5, 6], params(n=1))],
    )
    assert results[0] == [MAX_TOKENS, MAX_TOKENS] and refused(results[1]) and results[2] == [MAX_TOKENS]


def test_engine_bounds_queued_prompt_tokens_but_an_empty_queue_takes_a_big_prompt(qwen3_ckpt: Path) -> None:
    big, eight = list(range(1, 31)), list(range(1, 9))
    # One slot: the first request runs; the big one is the first to wait, so it is taken.
    results = arrive_together(
        qwen3_ckpt, QueueLimits(max_queued_tokens=20), [(eight, params()), (big, params()), (eight, params())]
    )
    assert results[:2] == [[MAX_TOKENS]] * 2 and refused(results[2])  # 30 waiting + 8 > 20
    assert "30 prompt tokens are already waiting" in str(results[2])
    results = arrive_together(qwen3_ckpt, QueueLimits(max_queued_tokens=20), [(eight, params())] * 4)
    assert results[:3] == [[MAX_TOKENS]] * 3 and refused(results[3])  # 8 + 8 waiting, + 8 > 20


def admission_with(
    bound_requests: int | None = None,
    bound_tokens: int | None = None,
    *,
    waiting: int = 0,
    running: int = 0,
    queued_tokens: int = 0,
    max_num_seqs: int = 4,
) -> Admission:
    """An Admission whose core last reported `running` and `waiting` requests."""
    admission = Admission(QueueLimits(bound_requests, bound_tokens), max_num_seqs)
    admission.on_sent(running + waiting, 1)
    admission.on_stats(
        SchedulerStats(running, waiting, 0, 1, 0, 0, 0, num_added=running + waiting, num_queued_tokens=queued_tokens)
    )
    return admission


@pytest.mark.parametrize(
    ("bound", "waiting", "running", "room"), [(1, 0, 4, 1), (3, 0, 4, 3), (3, 2, 4, 1), (2, 0, 0, 6), (2, 5, 0, 1)]
)
def test_early_check_counts_requests_being_tokenized(bound: int, waiting: int, running: int, room: int) -> None:
    admission = admission_with(bound, waiting=waiting, running=running)  # 4 slots, `running` of them taken
    with ExitStack() as preparing:
        for _ in range(room):
            preparing.enter_context(admission.preparing())
        with pytest.raises(EngineOverloadedError) as info:
            preparing.enter_context(admission.preparing())
        assert f"{bound} requests are already waiting for a batch slot (limit {bound})" in str(info.value)
    assert admission.num_preparing == 0
    with admission.preparing():
        assert admission.num_preparing == 1


def test_early_check_refuses_once_queued_tokens_reach_the_bound() -> None:
    with admission_with(None, 100, waiting=5, running=4, queued_tokens=99).preparing():
        pass
    with pytest.raises(EngineOverloadedError, match="100 prompt tokens are already waiting"):
        with admission_with(None, 100, waiting=5, running=4, queued_tokens=100).preparing():
            pass


def test_samples_in_transit_count_until_the_core_reports_them() -> None:
    """Sent samples count as waiting until a report of the core counts them itself (`num_added`);
    then the core's own waiting count takes over."""
    admission = Admission(QueueLimits(max_queued_requests=8), max_num_seqs=2)
    admission.on_sent(3, 10)  # one request of n = 3, prompt of 10 tokens: 1 queued past the 2 slots
    assert (admission.num_queued_requests(), admission.num_queued_tokens()) == (1, 10)
    admission.on_stats(SchedulerStats(0, 0, 0, 1, 0, 0, 0, num_added=0))  # a report from before they arrived
    assert admission.num_queued_requests() == 1
    admission.on_stats(SchedulerStats(2, 1, 0, 1, 0, 0, 0, num_added=3, num_queued_tokens=10))
    assert (admission.num_queued_requests(), admission.num_queued_tokens()) == (1, 10)
    admission.on_sent(1, 7)
    assert (admission.num_queued_requests(), admission.num_queued_tokens()) == (2, 17)
    admission.on_stats(SchedulerStats(2, 0, 0, 1, 0, 0, 0, num_added=4))  # all running or done
    assert (admission.num_queued_requests(), admission.num_queued_tokens()) == (0, 0)


class Source:
    """An engine-like stream of outputs the test hands out one at a time (`release`); records that
    it waited for one, and that it was closed."""

    def __init__(self) -> None:
        self.ready: asyncio.Queue[None] = asyncio.Queue()
        self.waiting = asyncio.Event()
        self.closed = False

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self.ready.put_nowait(None)

    async def items(self) -> AsyncIterator[RequestOutput]:
        try:
            i = 0
            while True:
                if self.ready.empty():
                    self.waiting.set()
                await self.ready.get()
                yield RequestOutput("r", 0, (i,), f"{i} ", None, 1, i + 1)
                i += 1
        finally:
            self.closed = True


async def drain(stream: EngineStream, on_item: Any = None) -> tuple[list[int], APIError]:
    got: list[int] = []
    with pytest.raises(APIError) as info:
        while (item := await stream.next()) is not None:
            got.append(item[1].new_token_ids[0])
            if on_item is not None:
                on_item(item[1].new_token_ids[0])
    await stream.aclose()
    return got, info.value


def test_a_passed_deadline_ends_the_stream_with_a_504_and_closes_the_engine_stream() -> None:
    async def main() -> tuple[list[int], APIError, float, bool]:
        source = Source()
        source.release(3)  # three outputs, then the engine has nothing more for longer than the deadline
        start = time.monotonic()
        got, error = await drain(EngineStream([source.items()], Deadline(0.2)))
        return got, error, time.monotonic() - start, source.closed

    got, error, elapsed, closed = asyncio.run(main())
    assert got == [0, 1, 2] and elapsed >= 0.2
    assert (error.status, error.type, error.code) == (504, "timeout_error", "request_timeout")
    assert error.headers == {"x-should-retry": "false"} and "0.2 s" in error.message
    assert closed


@pytest.mark.parametrize("waits", [True, False])
def test_expire_ends_a_stream_at_once_even_when_outputs_are_always_ready(waits: bool) -> None:
    async def main() -> tuple[list[int], APIError, bool]:
        source = Source()
        deadline = Deadline(None)
        stream = EngineStream([source.items()], deadline)
        if waits:  # expire while the stream waits for its next output
            consumer = asyncio.create_task(drain(stream))
            await source.waiting.wait()
            deadline.expire(server_stopping_error())
            got, error = await consumer
        else:  # expire between outputs that never make the stream wait
            source.release(1000)
            got, error = await drain(stream, lambda i: i == 2 and deadline.expire(server_stopping_error()))
        return got, error, source.closed

    got, error, closed = asyncio.run(main())
    assert closed
    assert got == ([] if waits else [0, 1, 2])
    assert (error.status, error.code) == (503, "server_stopping")


def test_a_drain_waits_for_the_last_request_and_gives_up_at_its_timeout() -> None:
    async def main() -> tuple[bool, bool, bool, bool, bool]:
        in_flight = InFlight(None, ServerMetrics())
        first, second = in_flight.track(), in_flight.track()
        first.__enter__()
        second.__enter__()
        waiting = asyncio.create_task(in_flight.wait_idle(60.0))
        first.__exit__(None, None, None)
        await asyncio.sleep(0)  # let the waiter run: one request is still in flight
        still_waiting = not waiting.done()
        second.__exit__(None, None, None)
        idle = await waiting
        with in_flight.track():
            timed_out = await in_flight.wait_idle(0.05)
            hurry = asyncio.Event()
            hurry.set()
            hurried = await in_flight.wait_idle(60.0, hurry)
        return still_waiting, idle, timed_out, hurried, in_flight.count == 0

    still_waiting, idle, timed_out, hurried, none_left = asyncio.run(main())
    assert still_waiting and idle and none_left
    assert not timed_out and not hurried


def test_api_loads_no_torch_before_the_model_does() -> None:
    import subprocess
    import sys

    from tests.server_utils import REPO

    code = "import sys, api.server, api.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
