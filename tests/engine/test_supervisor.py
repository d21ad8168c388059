"""The engine supervisor's parts, without restarting anything: the watchdog's rule over the
heartbeat (a step past its timeout, requests the engine never takes, a stalled loop with requests;
never an idle engine), the backoff, the heartbeat the engine loop writes each step, and the front's
side of a lost engine (every request it held ends; one not yet streaming raises
EngineRestartingError; the next request is served). tests/engine/test_engine_restart.py restarts real
engine processes under a real server."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.client.supervisor import FIRST_STEP_FACTOR, MAX_BACKOFF_S, RestartPolicy
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_proc import EngineCoreLoop, Message
from engine.core_types import AddRequests, EngineCoreOutputs, EngineCoreRequest, Shutdown
from engine.front.async_engine import AsyncEngine, EngineRestartingError
from engine.host.allocator import memory_releaser
from engine.host.heartbeat import BatchShape, Heartbeat, HeartbeatReading
from scheduler.output import ScheduledRequest
from scheduler.request import SamplingParams

POLICY = RestartPolicy(step_timeout_s=10.0)
SHAPE = BatchShape(num_requests=3, num_tokens=530, num_prefills=1, num_prefill_tokens=528)
T = 1000.0  # a monotonic time


def reading(in_step: bool = False, step_started: float = T, alive: float = T, num_steps: int = 5) -> HeartbeatReading:
    return HeartbeatReading(in_step, step_started, alive, num_steps, SHAPE)


def test_a_step_past_the_step_timeout_is_a_hang_named_by_its_batch_shape() -> None:
    beat = reading(in_step=True, step_started=T)
    assert POLICY.hang(beat, last_sent=0.0, busy=True, now=T + 9.9) is None
    why = POLICY.hang(beat, last_sent=0.0, busy=True, now=T + 10.5)
    assert why == (
        "a step made no progress for 10.5 s (limit 10 s; batch: 3 requests, 530 tokens: 1 prefills "
        "(528 tokens), 2 decodes)"
    )


def test_the_first_step_of_an_engine_on_a_gpu_gets_more_time() -> None:
    first = reading(in_step=True, step_started=T, num_steps=0)
    gpu = POLICY.for_device("cuda:0")
    assert gpu.hang(first, 0.0, True, T + 10.5) is None
    assert gpu.hang(first, 0.0, True, T + 10.0 * FIRST_STEP_FACTOR + 0.1) is not None
    assert POLICY.for_device("cpu").hang(first, 0.0, True, T + 10.5) is not None  # nothing compiles there


def test_requests_the_engine_never_takes_count_as_a_hang() -> None:
    idle = reading(alive=T)  # blocked on its inbox since T, e.g. frozen by SIGSTOP
    assert POLICY.hang(idle, last_sent=T + 1, busy=False, now=T + 10.9) is None
    assert (
        POLICY.hang(idle, last_sent=T + 1, busy=False, now=T + 11.5)
        == f"the engine took no new requests for 10.5 s (limit 10 s; last batch: {SHAPE})"
    )


def test_a_loop_stalled_outside_a_step_with_requests_in_it_is_a_hang() -> None:
    stalled = reading(alive=T)
    assert POLICY.hang(stalled, last_sent=0.0, busy=True, now=T + 11) is not None
    assert POLICY.hang(stalled, last_sent=0.0, busy=False, now=T + 11) is None


@pytest.mark.parametrize("now", [T + 11, T + 3600])
def test_an_idle_engine_is_never_a_hang(now: float) -> None:
    # Its last requests were taken (alive after last_sent) and its last report had none left.
    assert POLICY.hang(reading(alive=T), last_sent=T - 1, busy=False, now=now) is None


def test_no_watchdog_with_a_zero_step_timeout() -> None:
    off = RestartPolicy(step_timeout_s=0.0)
    assert off.hang(reading(in_step=True, step_started=T), T, True, T + 1e6) is None


def test_restarts_back_off_doubling_up_to_a_cap() -> None:
    assert [POLICY.backoff_s(k) for k in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert POLICY.backoff_s(20) == MAX_BACKOFF_S


def test_the_heartbeat_tells_prefills_from_decodes_and_drafts() -> None:
    beat = Heartbeat()
    before = beat.read()
    assert not before.in_step and before.num_steps == 0
    requests = [
        ScheduledRequest("p", tuple(range(40)), 0, (0, 1, 2), sample=False),
        ScheduledRequest("d", (7,), 90, (3,), sample=True),
        ScheduledRequest("s", (7, 8, 9), 50, (4,), sample=True, num_draft_tokens=2),  # a decode with drafts
    ]
    beat.step_begins(requests)
    during = beat.read()
    assert during.in_step and during.step_started >= before.alive
    assert during.shape == BatchShape(num_requests=3, num_tokens=44, num_prefills=1, num_prefill_tokens=40)
    beat.step_ends()
    after = beat.read()
    assert not after.in_step and after.num_steps == 1 and after.alive >= during.step_started


@pytest.fixture(scope="module")
def tiny_core(qwen3_ckpt: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=1))


def test_the_engine_loop_beats_once_per_step_and_frees_memory_once_idle(tiny_core: EngineCore) -> None:
    beat = Heartbeat()
    releases: list[int] = []
    steps: list[EngineCoreOutputs] = []
    finished = threading.Event()

    def emit(outputs: EngineCoreOutputs) -> None:
        if outputs.step_time_s is not None:
            steps.append(outputs)
        if any(o.finish_reason for o in outputs.outputs):
            finished.set()

    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    loop = threading.Thread(
        target=EngineCoreLoop(tiny_core, emit, beat, lambda: releases.append(len(steps))).run, args=(inbox,)
    )
    loop.start()
    request = EngineCoreRequest("r", (5, 6, 7, 8), SamplingParams(max_tokens=6, ignore_eos=True), (), 0.0)
    inbox.put(AddRequests((request,)))
    assert finished.wait(60)
    inbox.put(Shutdown())
    loop.join(10)
    got = beat.read()
    assert not got.in_step and got.num_steps == len(steps) == 6  # a 4-token prefill, then five decodes
    assert got.shape == BatchShape(num_requests=1, num_tokens=1, num_prefills=0, num_prefill_tokens=0)
    assert releases == [6]  # once, when it went idle after the work; not while it idled before


def test_the_engine_process_can_return_freed_memory() -> None:
    release = memory_releaser()
    assert release is not None, "glibc's malloc_trim, on Linux"
    release()


@pytest.fixture
def engine(tiny_core: EngineCore) -> Iterator[AsyncEngine]:
    yield AsyncEngine(tiny_core)
    assert tiny_core.scheduler.stats().num_used_blocks == 0, "a test left KV pages held"


def test_a_lost_engine_ends_streaming_and_waiting_requests_and_the_next_one_is_served(engine: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main() -> tuple[list[Any], BaseException | None, list[Any]]:
        await engine.start()
        try:
            streaming = engine.generate([5, 6, 7], long, "streaming")
            first = await anext(streaming)
            # max_num_seqs is 1: this one waits behind the first and has sent nothing.
            waiting = engine.generate([8, 9], long, "waiting")
            waiting_first = asyncio.ensure_future(anext(waiting))
            await asyncio.sleep(0)  # let it reach the engine
            # What engine/client/supervisor.py sends when the engine process dies.
            engine._from_core(EngineCoreOutputs(dead="the engine process exited (exit code -9)", restart="crash"))
            rest = [out async for out in streaming]
            try:
                await waiting_first
                refused = None
            except EngineRestartingError as e:
                refused = e
            short = SamplingParams(max_tokens=3, ignore_eos=True)
            after = [out async for out in engine.generate([5, 6], short, "after")]
            return [first, *rest], refused, after
        finally:
            await engine.shutdown()

    streamed, refused, after = asyncio.run(main())
    assert all(out.error is None for out in streamed[:-1])
    assert streamed[-1].error is not None and "exit code -9" in streamed[-1].error and "retry" in streamed[-1].error
    assert isinstance(refused, EngineRestartingError)
    assert not engine.dead and engine.metrics.engine_restarts.labels(reason="crash")._value.get() == 1
    assert [out.finish_reason for out in after][-1] == "length" and sum(len(o.new_token_ids) for o in after) == 3
