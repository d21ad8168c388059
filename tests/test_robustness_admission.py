"""The pieces that keep a flood, a slow request or a shutdown from hurting anyone else, without a
server: the engine admits exactly up to its queue bounds (and an empty queue takes anything), the
early check counts requests being tokenized, a deadline ends an engine stream and closes it, and
a drain waits for the last request or gives up at its timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from api.admission import Admission
from api.deadline import Deadline, server_stopping_error, until_deadline
from api.errors import APIError
from api.inflight import InFlight
from api.metrics import ServerMetrics
from engine.async_engine import AsyncEngine, EngineOverloadedError, QueueLimits
from engine.config import EngineConfig
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


def arrive_together(path: Path, limits: QueueLimits, requests: list[tuple[list[int], SamplingParams]],
                    max_num_seqs: int = 1) -> list[Any]:
    """All requests reach an idle engine in one event-loop tick, before it schedules a step."""

    async def main() -> list[Any]:
        # In-process: the queue is counted in the front either way (tests/test_engine_proc.py covers
        # the engine process), and a process per case would cost seconds each.
        engine = AsyncEngine.from_config(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="8MiB",
                                                      max_num_seqs=max_num_seqs, engine_process=False))
        await engine.start(limits)
        try:
            results = await asyncio.gather(*(outcome(engine, f"r{i}", prompt, p) for i, (prompt, p) in enumerate(requests)))
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
    qwen3_ckpt: Path, max_num_seqs: int, bound: int,
) -> None:
    admitted = max_num_seqs + bound
    results = arrive_together(qwen3_ckpt, QueueLimits(max_queued_requests=bound), [([5, 6, 7], params())] * 8,
                              max_num_seqs)
    assert results[:admitted] == [[MAX_TOKENS]] * admitted  # admitted ones finish whole
    assert all(refused(r) for r in results[admitted:8])
    assert f"{bound} requests are already waiting for a batch slot (limit {bound})" in str(results[admitted])
    assert results[8] == [MAX_TOKENS]


def test_each_of_n_samples_counts_against_the_request_bound(qwen3_ckpt: Path) -> None:
    # One slot: the first request's second sample is the one queued; 1 + 2 > 2, then 1 + 1 fits.
    results = arrive_together(qwen3_ckpt, QueueLimits(max_queued_requests=2),
                              [([5, 6], params(n=2)), ([5, 6], params(n=2)), ([5, 6], params(n=1))])
    assert results[0] == [MAX_TOKENS, MAX_TOKENS] and refused(results[1]) and results[2] == [MAX_TOKENS]


def test_engine_bounds_queued_prompt_tokens_but_an_empty_queue_takes_a_big_prompt(qwen3_ckpt: Path) -> None:
    big, eight = list(range(1, 31)), list(range(1, 9))
    # One slot: the first request runs; the big one is the first to wait, so it is taken.
    results = arrive_together(qwen3_ckpt, QueueLimits(max_queued_tokens=20),
                              [(eight, params()), (big, params()), (eight, params())])
    assert results[:2] == [[MAX_TOKENS]] * 2 and refused(results[2])  # 30 waiting + 8 > 20
    assert "30 prompt tokens are already waiting" in str(results[2])
    results = arrive_together(qwen3_ckpt, QueueLimits(max_queued_tokens=20), [(eight, params())] * 4)
    assert results[:3] == [[MAX_TOKENS]] * 3 and refused(results[3])  # 8 + 8 waiting, + 8 > 20


class FakeQueue:
    """What Admission reads of AsyncEngine: `waiting` requests and `free` batch slots."""

    def __init__(self, waiting: int = 0, free: int = 0, tokens: int = 0) -> None:
        self.waiting, self.free, self.tokens = waiting, free, tokens

    def num_queued_requests(self, arriving: int = 0) -> int:
        return max(0, self.waiting + arriving - self.free)

    def num_queued_tokens(self) -> int:
        return self.tokens


def assert_overloaded(error: APIError) -> None:
    assert (error.status, error.type, error.code) == (503, "overloaded_error", "server_overloaded")
    assert error.headers == {"Retry-After": "1"}


@pytest.mark.parametrize(("bound", "waiting", "free", "room"), [(1, 0, 0, 1), (3, 0, 0, 3), (3, 2, 0, 1), (2, 0, 4, 6),
                                                                 (2, 5, 4, 1)])
def test_early_check_counts_requests_being_tokenized(bound: int, waiting: int, free: int, room: int) -> None:
    metrics = ServerMetrics()
    admission = Admission(QueueLimits(max_queued_requests=bound), metrics)
    queue = FakeQueue(waiting=waiting, free=free)
    with ExitStack() as preparing:
        for _ in range(room):
            preparing.enter_context(admission.preparing(queue))  # type: ignore[arg-type]
        with pytest.raises(APIError) as info:
            preparing.enter_context(admission.preparing(queue))  # type: ignore[arg-type]
        assert_overloaded(info.value)
        assert f"{bound} requests are already waiting for a batch slot (limit {bound})" in info.value.message
    assert admission.num_preparing == 0
    with admission.preparing(queue):  # type: ignore[arg-type]
        assert admission.num_preparing == 1
    assert metrics.rejected.labels(reason="overloaded")._value.get() == 1


def test_early_check_refuses_once_queued_tokens_reach_the_bound() -> None:
    admission = Admission(QueueLimits(max_queued_tokens=100), ServerMetrics())
    with admission.preparing(FakeQueue(tokens=99)):  # type: ignore[arg-type]
        pass
    with pytest.raises(APIError) as info, admission.preparing(FakeQueue(tokens=100)):  # type: ignore[arg-type]
        pass
    assert_overloaded(info.value)


class Source:
    """An engine-like stream: one item every `interval` seconds; records being closed."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.closed = False

    async def items(self) -> AsyncIterator[int]:
        try:
            i = 0
            while True:
                if self.interval:
                    await asyncio.sleep(self.interval)
                yield i
                i += 1
        finally:
            self.closed = True


async def drain(outputs: AsyncIterator[int], on_item: Any = None) -> tuple[list[int], APIError]:
    got: list[int] = []
    with pytest.raises(APIError) as info:
        async for item in outputs:
            got.append(item)
            if on_item is not None:
                on_item(item)
    return got, info.value


def test_a_passed_deadline_closes_the_stream_and_raises_a_504() -> None:
    source = Source(interval=0.05)

    async def main() -> tuple[list[int], APIError, float]:
        start = time.monotonic()
        got, error = await drain(until_deadline(source.items(), Deadline(0.3)))
        return got, error, time.monotonic() - start

    got, error, elapsed = asyncio.run(main())
    assert 0.3 <= elapsed < 0.6 and 3 <= len(got) <= 6 and got == list(range(len(got)))
    assert (error.status, error.type, error.code) == (504, "timeout_error", "request_timeout")
    assert error.headers == {"x-should-retry": "false"} and "0.3 s" in error.message
    assert source.closed


@pytest.mark.parametrize("interval", [10.0, 0.0])
def test_expire_ends_a_stream_at_once_even_when_items_are_always_ready(interval: float) -> None:
    source = Source(interval)

    async def main() -> tuple[list[int], APIError, float]:
        deadline = Deadline(None)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        if interval:  # expire while the stream waits for its next item
            loop.call_later(0.05, deadline.expire, server_stopping_error())
            got, error = await drain(until_deadline(source.items(), deadline))
        else:  # expire between items that never make the stream wait
            got, error = await drain(until_deadline(source.items(), deadline),
                                     lambda i: i == 2 and deadline.expire(server_stopping_error()))
        return got, error, time.monotonic() - start

    got, error, elapsed = asyncio.run(main())
    assert elapsed < 1.0 and source.closed
    assert got == ([] if interval else [0, 1, 2])
    assert (error.status, error.code) == (503, "server_stopping")


def test_a_drain_waits_for_the_last_request_and_gives_up_at_its_timeout() -> None:
    async def main() -> tuple[bool, bool, bool, float]:
        in_flight = InFlight(None, ServerMetrics())
        loop = asyncio.get_running_loop()
        first, second = in_flight.track(), in_flight.track()
        first.__enter__()
        second.__enter__()
        loop.call_later(0.05, first.__exit__, None, None, None)
        loop.call_later(0.1, second.__exit__, None, None, None)
        start = time.monotonic()
        idle = await in_flight.wait_idle(5.0)
        waited = time.monotonic() - start
        with in_flight.track():
            timed_out = await in_flight.wait_idle(0.05)
            hurry = asyncio.Event()
            loop.call_later(0.05, hurry.set)
            hurried = await in_flight.wait_idle(5.0, hurry)
        return idle, timed_out, hurried, waited

    idle, timed_out, hurried, waited = asyncio.run(main())
    assert idle and 0.1 <= waited < 1.0
    assert not timed_out and not hurried


def test_api_loads_no_torch_before_the_model_does() -> None:
    import subprocess
    import sys

    from tests.server_utils import REPO

    code = "import sys, api.server, api.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
