"""Async scheduling (vLLM's `async_scheduling`): step n+1 is scheduled and launched before step n
is read back. The scheduler's placeholders and their filling, the one extra step of a request
that stopped, and, through the real engine loop on CPU, outputs token-identical to the
synchronous loop."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_proc import EngineCoreLoop
from engine.core_types import AbortRequests, AddRequests, EngineCoreOutputs, EngineCoreRequest, Shutdown
from engine.step_result import PendingStep
from scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from scheduler.request import FinishReason, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.factories import make_request


def small_scheduler(**overrides: Any) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64)
    return Scheduler(SchedulerConfig(**(config | overrides)))


# ---- the scheduler ---------------------------------------------------------------------------------
def test_a_step_scheduled_ahead_decodes_a_placeholder_that_update_fills() -> None:
    s = small_scheduler()
    s.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    first = s.schedule(async_step=True)
    assert first.async_step and first.requests[0].token_ids == (1, 2, 3, 4, 5) and first.requests[0].sample
    assert s.can_schedule_ahead()
    second = s.schedule(async_step=True)  # while the first is in flight
    (r,) = second.requests
    assert (r.start_pos, r.token_ids, r.sample) == (5, (PLACEHOLDER_TOKEN_ID,), True)
    request = s.requests["a"]
    assert (request.num_computed_tokens, request.num_output_placeholders) == (6, 2)
    s.update(first, {"a": 40})
    assert request.output_token_ids == [40] and request.num_output_placeholders == 1
    third = s.schedule(async_step=True)
    assert (third.requests[0].start_pos, third.requests[0].token_ids) == (6, (PLACEHOLDER_TOKEN_ID,))
    s.update(second, {"a": 41})
    s.update(third, {"a": 42})
    assert request.output_token_ids == [40, 41, 42]
    s.block_manager.check_invariants()


def test_a_request_stopping_in_flight_runs_one_extra_step_whose_token_is_dropped() -> None:
    s = small_scheduler()
    s.add_request(make_request("a", 3, max_tokens=10, stop_token_ids=(9,)))
    first = s.schedule(async_step=True)
    second = s.schedule(async_step=True)
    touched = s.update(first, {"a": 9})  # a stop token: finished while `second` still runs
    assert touched[0].finish_reason is FinishReason.STOP and "a" not in s.requests
    assert s.block_manager.num_used_blocks == 0
    assert s.update(second, {"a": 77}) == []  # the extra step's token goes nowhere
    assert s.schedule(async_step=True).finished_request_ids == ("a",)
    s.block_manager.check_invariants()


def test_placeholders_at_max_tokens_schedule_no_step_past_it() -> None:
    s = small_scheduler()
    s.add_request(make_request("a", 3, max_tokens=1))
    first = s.schedule(async_step=True)
    assert s.schedule(async_step=True).is_empty  # its one token is in flight: nothing left to run
    s.update(first, {"a": 5})
    assert s.requests == {} and s.block_manager.num_used_blocks == 0


def test_a_page_with_a_token_in_flight_enters_the_prefix_cache_only_once_it_is_known() -> None:
    s = small_scheduler()
    s.add_request(make_request("a", 3, max_tokens=8, ignore_eos=True))
    first = s.schedule(async_step=True)  # prompt rows 0..2, samples position 3's token
    second = s.schedule(async_step=True)  # position 3: a placeholder completes page 0
    request = s.requests["a"]
    assert request.num_registered_blocks == 0 and not s.block_manager.cached
    s.update(first, {"a": 40})
    s.update(second, {"a": 41})
    s.schedule(async_step=True)
    assert request.block_hashes and s.block_manager.cached[request.block_hashes[0]] == request.block_table[0]


def test_scheduling_ahead_waits_where_pages_could_run_short_or_a_grammar_runs() -> None:
    s = small_scheduler(num_blocks=20)  # a 64-token budget alone wants 16 pages of 4
    for i in range(5):
        s.add_request(make_request(f"r{i}", 3, max_tokens=4))
    s.schedule(async_step=True)
    assert not s.can_schedule_ahead()
    assert small_scheduler().can_schedule_ahead()


# ---- the engine loop, on CPU -----------------------------------------------------------------------
PROMPTS = [list(range(3, 30)), [5, 6, 7, 8], [9, 10, 11], [12, 13], [40, 41, 42, 43, 44]]


def params_for(stop_token: int | None) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),  # a chunked prefill, then greedy
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(
            max_tokens=9,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            seed=3,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            min_tokens=2,
        ),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_token,) if stop_token is not None else ()),
    ]


class Recording:
    """The core, counting the launched rows whose token was still in flight when scheduled."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.num_placeholders = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def launch(self, out: SchedulerOutput) -> PendingStep:
        self.num_placeholders += sum(r.token_ids.count(PLACEHOLDER_TOKEN_ID) for r in out.requests)
        return self._core.launch(out)


def run_loop(core: Any, params: list[SamplingParams]) -> tuple[dict[str, list[int]], dict[str, Any], list[Any]]:
    """Every request through EngineCoreLoop.run on a thread; returns tokens, finishes and logprobs."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(params))}
    finished: dict[str, Any] = {}
    logprobs: list[Any] = []
    all_done = threading.Event()

    def emit(outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            assert len(out.new_token_ids) <= 1, "a token per step: outputs still stream per token"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.logprob is not None:
                logprobs.append((out.request_id, out.logprob, out.top_ids))
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        if len(finished) == len(params):
            all_done.set()

    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    now = time.monotonic()
    inbox.put(
        AddRequests(
            tuple(
                EngineCoreRequest(f"r{i}", tuple(prompt), p, (511,), now)
                for i, (prompt, p) in enumerate(zip(PROMPTS, params))
            )
        )
    )
    thread = threading.Thread(target=EngineCoreLoop(core, emit).run, args=(inbox,))
    thread.start()
    assert all_done.wait(120), f"finished only {sorted(finished)}"
    inbox.put(Shutdown())
    thread.join(60)
    return tokens, finished, logprobs


@pytest.fixture(scope="module")
def cores(qwen3_ckpt: Path) -> dict[bool, EngineCore]:
    base = dict(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, block_size=4)
    return {on: EngineCore(EngineConfig(**base, async_scheduling=on)) for on in (False, True)}  # type: ignore[arg-type]


def test_async_scheduling_streams_exactly_what_the_synchronous_loop_does(cores: dict[bool, EngineCore]) -> None:
    assert cores[True].async_scheduling and not cores[False].async_scheduling
    sync_tokens, _, _ = run_loop(cores[False], params_for(None))
    # A stop token the last request meets part way: its async run steps once past it.
    stop = sync_tokens["r4"][4]
    expected = run_loop(cores[False], params_for(stop))
    recording = Recording(cores[True])
    got = run_loop(recording, params_for(stop))
    assert recording.num_placeholders > 20, "the steps were not scheduled ahead"
    tokens, finished, logprobs = got
    assert (tokens, finished) == expected[:2]
    # NOTE: a batch's rows may differ (the stopped request's extra step), and the CPU matmul's
    # rounding depends on the row count: logprobs agree to float32's precision, not bit for bit.
    assert [(rid, top) for rid, _, top in logprobs] == [(rid, top) for rid, _, top in expected[2]]
    assert [lp for _, lp, _ in logprobs] == pytest.approx([lp for _, lp, _ in expected[2]], rel=1e-5)
    assert finished["r4"] == "stop" and tokens["r4"][-1] == stop and len(tokens["r4"]) <= 5
    assert finished["r3"] == "length" and len(tokens["r3"]) == 1
    for core in cores.values():
        assert core.scheduler.block_manager.num_used_blocks == 0
        core.scheduler.block_manager.check_invariants()


def test_async_scheduling_is_off_by_default_on_cpu(qwen3_ckpt: Path) -> None:
    core = EngineCore(EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="8MiB"))
    assert not core.async_scheduling


def test_an_abort_while_a_step_is_in_flight_frees_its_pages(cores: dict[bool, EngineCore]) -> None:
    core = cores[True]
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    b_done = threading.Event()

    def emit(outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.request_id == "a" and len(tokens["a"]) == 3:
                inbox.put(AbortRequests(("a",)))  # applied between steps, one step in flight
            if out.request_id == "b" and out.finish_reason is not None:
                b_done.set()

    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    now = time.monotonic()
    inbox.put(
        AddRequests(
            (
                EngineCoreRequest("a", (5, 6, 7), greedy, (511,), now),
                EngineCoreRequest("b", (8, 9), greedy, (511,), now),
            )
        )
    )
    thread = threading.Thread(target=EngineCoreLoop(core, emit).run, args=(inbox,))
    thread.start()
    assert b_done.wait(120)
    inbox.put(Shutdown())
    thread.join(60)
    assert 3 <= len(tokens["a"]) < 20 and len(tokens["b"]) == 20
    assert core.scheduler.block_manager.num_used_blocks == 0 and not core.scheduler.requests
    core.scheduler.block_manager.check_invariants()
