"""Scheduler: token budget, chunked prefill, decode priority, admission, abort, preemption and
resumption, stop conditions, and what reaches the runner — driven with fake sampled tokens."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.output import NewRequestData, SchedulerOutput
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99

# ---- factories and a step driver ----------------------------------------------------------------


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
    )


def make_request(
    request_id: str, prompt: list[int], arrival: float, max_tokens: int | None = None, **params: object
) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,), arrival_time=arrival
    )


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# Default fake sampler: 100 + position in the output, so each output token shows where it came from.
def by_position(request: Request) -> int:
    return 100 + request.num_output_tokens


def run_step(sched: Scheduler, sample: Callable[[Request], int] = by_position) -> SchedulerOutput:
    """One step: schedule, check what every step must hold, feed fake sampled tokens back."""
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.requests) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    for sr in out.requests:
        req = sched.requests[sr.request_id]
        assert sr.token_ids == tuple(req.token_slice(sr.start_pos, sr.seq_len))
        assert len(sr.block_table) == -(-sr.seq_len // cfg.block_size)
        assert sr.sample == (sr.seq_len == req.num_tokens)
    sampled = {sr.request_id: sample(sched.requests[sr.request_id]) for sr in out.requests if sr.sample}
    sched.update(out, sampled)
    return out


def run_steps(
    sched: Scheduler, num_steps: int, sample: Callable[[Request], int] = by_position
) -> list[SchedulerOutput]:
    return [run_step(sched, sample) for _ in range(num_steps)]


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start position, new tokens, sample) per scheduled request, in batch order."""
    return [(sr.request_id, sr.start_pos, sr.num_new_tokens, sr.sample) for sr in out.requests]


# ---- budget and chunked prefill -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "prompt_len", "chunks"),
    [(16, 40, [16, 16, 8]), (8, 8, [8]), (5, 11, [5, 5, 1]), (4, 13, [4, 4, 4, 1])],
)
def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks(
    budget: int, prompt_len: int, chunks: list[int]
) -> None:
    sched = make_scheduler(max_num_batched_tokens=budget)
    prompt = tokens(1, prompt_len)
    sched.add_request(make_request("r", prompt, arrival=0.0))
    outs = run_steps(sched, len(chunks) + 1)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    assert [plan(o) for o in outs[:-1]] == [[("r", s, n, s + n == prompt_len)] for s, n in zip(starts, chunks)]
    for out, s, n in zip(outs, starts, chunks):
        (sr,) = out.requests
        assert sr.token_ids == tuple(prompt[s : s + n])
        assert sr.block_table == tuple(range(-(-(s + n) // 4)))
    # The step after the last chunk decodes the token sampled from it.
    (decode,) = outs[-1].requests
    assert (decode.start_pos, decode.token_ids, decode.sample) == (prompt_len, (100,), True)


def test_token_budget_is_filled_oldest_first_and_the_rest_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, tokens(10 * i + 1, 6), arrival=float(i)))
    outs = run_steps(sched, 3)
    assert plan(outs[0]) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert plan(outs[1]) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 6, True)]
    assert plan(outs[2]) == [("a", 7, 1, True), ("b", 6, 1, True), ("c", 6, 1, True)]
    assert [o.num_batched_tokens for o in outs] == [10, 9, 3]


def test_max_num_seqs_caps_the_running_set_and_a_freed_seat_is_taken_next_step() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, tokens(10 * i + 1, 3), arrival=float(i), max_tokens=2))
    outs = run_steps(sched, 4)
    assert [[sr.request_id for sr in o.requests] for o in outs] == [["a", "b"], ["a", "b"], ["c"], ["c"]]
    assert sched.stats().num_waiting == 0 and not sched.has_unfinished()
    assert [o.finished_request_ids for o in outs] == [(), (), ("a", "b"), ()]


def test_decodes_are_never_starved_by_a_long_prefill() -> None:
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=30)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", tokens(10 * i + 1, 4), arrival=float(i)))
    run_step(sched)  # the four short prompts prefill together
    sched.add_request(make_request("long", tokens(1000, 200), arrival=10.0))
    outs = run_steps(sched, 9)
    for step, out in enumerate(outs[:8]):  # 200 = 7 * 26 + 18
        n = 26 if step < 7 else 18
        assert plan(out) == [(f"d{i}", 4 + step, 1, True) for i in range(4)] + [("long", 26 * step, n, step == 7)]
    assert plan(outs[8]) == [(f"d{i}", 12, 1, True) for i in range(4)] + [("long", 200, 1, True)]


def test_a_request_added_during_a_step_joins_at_the_next_step() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(1, 5), arrival=0.0))
    in_flight = sched.schedule()
    sched.add_request(make_request("b", tokens(50, 3), arrival=1.0))  # arrives while the step runs
    sched.update(in_flight, {"a": 100})
    assert plan(in_flight) == [("a", 0, 5, True)]
    assert plan(run_step(sched)) == [("a", 5, 1, True), ("b", 0, 3, True)]


# ---- what reaches the runner ----------------------------------------------------------------------
def test_new_request_data_is_sent_only_the_first_time_a_request_is_scheduled() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=None, temperature=0.5, seed=3)
    sched.add_request(Request("r", tokens(1, 10), params, eos_token_ids=(EOS, 98), arrival_time=0.0))
    outs = run_steps(sched, 4)
    assert outs[0].requests[0].new_request == NewRequestData(params, tuple(tokens(1, 10)), (EOS, 98))
    assert [o.requests[0].new_request for o in outs[1:]] == [None, None, None]


def test_finished_request_ids_reach_exactly_the_next_output_once() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(1, 3), arrival=0.0, max_tokens=1))
    sched.add_request(make_request("b", tokens(10, 3), arrival=1.0, max_tokens=3))
    outs = run_steps(sched, 4)
    assert [o.finished_request_ids for o in outs] == [(), ("a",), (), ("b",)]
    assert run_step(sched).finished_request_ids == ()


# ---- abort ----------------------------------------------------------------------------------------
def test_abort_of_a_running_request_frees_its_pages_at_once() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(1, 9), arrival=0.0))
    run_step(sched)
    assert sched.stats().num_used_blocks == 3
    aborted = sched.abort_request("a")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert aborted.status is RequestStatus.FINISHED and aborted.block_table == []
    stats = sched.stats()
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert sched.abort_request("a") is None  # a second abort is a no-op
    assert run_step(sched).finished_request_ids == ("a",)
    assert run_step(sched).finished_request_ids == ()


def test_abort_while_its_step_runs_skips_the_request_in_update() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(1, 5), arrival=0.0))
    sched.add_request(make_request("b", tokens(10, 5), arrival=1.0))
    in_flight = sched.schedule()
    b = sched.abort_request("b")
    assert sched.stats().num_used_blocks == 2  # only a's pages are left
    touched = sched.update(in_flight, {"a": 100, "b": 100})
    assert [r.request_id for r in touched] == ["a"]
    assert b is not None and b.output_token_ids == [] and b.num_computed_tokens == 0
    assert sched.schedule().finished_request_ids == ("b",)


def test_abort_of_a_waiting_request_that_never_ran_is_not_reported_to_the_runner() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", tokens(1, 3), arrival=0.0))
    sched.add_request(make_request("b", tokens(10, 3), arrival=1.0))
    run_step(sched)
    assert sched.stats().num_waiting == 1
    assert sched.abort_request("b") is not None
    stats = sched.stats()
    assert (stats.num_waiting, stats.num_used_blocks) == (0, 1)
    assert run_step(sched).finished_request_ids == ()


def test_finish_request_for_an_outside_stop_frees_pages_and_keeps_the_reason() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(1, 6), arrival=0.0))
    run_step(sched)
    a = sched.requests["a"]
    sched.finish_request("a", FinishReason.STOP, "</end>")
    assert (a.finish_reason, a.stop_reason, a.status) == (FinishReason.STOP, "</end>", RequestStatus.FINISHED)
    assert sched.stats().num_used_blocks == 0
    assert run_step(sched).finished_request_ids == ("a",)


# ---- stop conditions ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "max_model_len", "sampled", "expected_outputs", "reason", "stop_reason"),
    [
        ({}, 256, [5, EOS, 6], [5, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 3}, 256, [5, EOS, 6, 7], [5, EOS, 6], FinishReason.LENGTH, None),
        ({"stop_token_ids": (42,)}, 256, [5, 42, 6], [5, 42], FinishReason.STOP, 42),
        ({"stop_token_ids": (42,), "ignore_eos": True}, 256, [EOS, 42], [EOS, 42], FinishReason.STOP, 42),
        ({"max_tokens": 3}, 256, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        ({}, 8, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),  # prompt 5 + 3 = max_model_len
        ({"min_tokens": 3}, 256, [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], FinishReason.STOP, None),
        ({"min_tokens": 2, "stop_token_ids": (42,)}, 256, [42, 42, 6], [42, 42], FinishReason.STOP, 42),
    ],
)
def test_update_finishes_on_the_first_stop_condition_met(
    params: dict[str, object],
    max_model_len: int,
    sampled: list[int],
    expected_outputs: list[int],
    reason: FinishReason,
    stop_reason: int | None,
) -> None:
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("r", tokens(1, 5), arrival=0.0, **params))
    request = sched.requests["r"]
    feed = iter(sampled)
    steps = 0
    while sched.has_unfinished():
        run_step(sched, lambda _: next(feed))
        steps += 1
    assert steps == len(expected_outputs)
    assert request.output_token_ids == expected_outputs
    assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)
    assert sched.stats().num_used_blocks == 0


# ---- prefix cache through the scheduler ------------------------------------------------------------
def test_a_shared_prefix_is_served_from_the_cache_at_first_schedule() -> None:
    sched = make_scheduler()
    system = tokens(1, 8)
    sched.add_request(make_request("a", system + [50, 51], arrival=0.0))
    run_step(sched)
    sched.add_request(make_request("b", system + [60, 61, 62], arrival=1.0))
    out = run_step(sched)
    assert plan(out) == [("a", 10, 1, True), ("b", 8, 3, True)]
    assert out.requests[1].block_table == (0, 1, 3)  # a's two full pages, then a fresh one
    assert out.requests[1].token_ids == (60, 61, 62)
    assert sched.requests["b"].num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (10 + 11, 8)


def test_forks_of_one_prompt_admitted_together_share_its_full_pages() -> None:
    sched = make_scheduler()
    prompt = tokens(1, 10)
    for i in range(3):
        sched.add_request(make_request(f"s{i}", prompt, arrival=0.0))
    out = run_step(sched)
    # The first sample computes the prompt; the others hit its two full pages in the same step.
    assert plan(out) == [("s0", 0, 10, True), ("s1", 8, 2, True), ("s2", 8, 2, True)]
    assert [sr.block_table for sr in out.requests] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]
    assert sched.block_manager.ref_counts[:5] == [3, 3, 1, 1, 1]


def test_prefix_cache_lookups_are_counted_once_per_admission() -> None:
    # b waits three steps for pages; its lookup must count once, when it is admitted.
    sched = make_scheduler(num_blocks=3, block_size=4)
    sched.add_request(make_request("a", tokens(1, 8), arrival=0.0, max_tokens=4))
    sched.add_request(make_request("b", tokens(1, 4) + [70, 71, 72, 73, 74], arrival=1.0))
    outs = run_steps(sched, 5)
    assert [[sr.request_id for sr in o.requests] for o in outs] == [["a"], ["a"], ["a"], ["a"], ["b"]]
    stats = sched.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (8 + 9, 4)


def test_disabled_prefix_caching_recomputes_a_repeated_prompt() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("a", tokens(1, 9), arrival=0.0))
    sched.add_request(make_request("b", tokens(1, 9), arrival=1.0))
    assert plan(run_step(sched)) == [("a", 0, 9, True), ("b", 0, 9, True)]
    assert sched.stats().prefix_cache_hit_tokens == 0


# ---- preemption under a tiny cache ------------------------------------------------------------------
def tiny_cache_after_preemption() -> tuple[Scheduler, list[SchedulerOutput]]:
    """Seven 2-token pages, three requests that fill them, and a fourth waiting: at step 3 `a` needs
    a page, so `c` (the youngest) is preempted."""
    sched = make_scheduler(num_blocks=7, block_size=2)
    sched.add_request(make_request("a", [1, 2, 3], arrival=1.0, max_tokens=3))
    sched.add_request(make_request("b", [11, 12, 13], arrival=2.0, max_tokens=4))
    sched.add_request(make_request("c", [21, 22, 23, 24, 25], arrival=3.0, max_tokens=5))
    outs = run_steps(sched, 2)
    sched.add_request(make_request("d", [31], arrival=4.0, max_tokens=1))
    outs.append(run_step(sched))
    return sched, outs


def test_preemption_takes_the_youngest_and_puts_it_at_the_front_of_the_waiting_queue() -> None:
    sched, outs = tiny_cache_after_preemption()
    assert plan(outs[0]) == [("a", 0, 3, True), ("b", 0, 3, True), ("c", 0, 5, True)]
    assert [sr.block_table for sr in outs[0].requests] == [(0, 1), (2, 3), (4, 5, 6)]
    assert plan(outs[1]) == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 5, 1, True)]
    # Step 3: c's pages go back tail first; a and b take its two tail pages, its head page stays cached.
    assert plan(outs[2]) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert outs[2].num_preempted == 1
    assert [sr.block_table for sr in outs[2].requests] == [(0, 1, 6), (2, 3, 5)]
    c = next(r for r in sched.waiting if r.request_id == "c")
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert (c.status, c.block_table, c.num_computed_tokens) == (RequestStatus.PREEMPTED, [], 0)
    assert c.output_token_ids == [100, 101]
    assert (c.num_preemptions, sched.stats().num_preemptions) == (1, 1)
    assert sched.block_manager.cached[c.block_hashes[0]] == 4
    # a finished at step 3 (max_tokens=3): only b's pages are in use.
    assert sched.stats().num_used_blocks == 3


def test_a_preempted_request_resumes_with_its_outputs_and_a_prefix_hit_on_surviving_pages() -> None:
    sched, outs = tiny_cache_after_preemption()
    c = next(r for r in sched.waiting if r.request_id == "c")
    outs += run_steps(sched, 4)
    # Step 4: c recomputes from its cached head page: prompt tail plus its two outputs, then samples.
    assert plan(outs[3]) == [("b", 5, 1, True), ("c", 2, 5, True)]
    resumed = outs[3].requests[1]
    assert resumed.token_ids == (23, 24, 25, 100, 101)
    assert resumed.block_table == (4, 6, 1, 0)
    assert resumed.new_request is None  # the runner already holds c's parameters
    assert outs[3].finished_request_ids == ("a",)
    assert c.num_cached_tokens == 0  # set only at first schedule, which had no hit
    # d waited behind c (no free page at step 4) and runs once b finishes.
    assert plan(outs[4]) == [("c", 7, 1, True), ("d", 0, 1, True)]
    assert plan(outs[5]) == [("c", 8, 1, True)]
    assert [o.finished_request_ids for o in outs[4:]] == [("b",), ("d",), ("c",)]
    assert c.output_token_ids == [100, 101, 102, 103, 104]
    assert c.finish_reason is FinishReason.LENGTH
    assert sched.stats().num_used_blocks == 0 and not sched.has_unfinished()


def test_abort_of_a_preempted_request_removes_it_from_the_queue_and_reports_it() -> None:
    sched, _ = tiny_cache_after_preemption()
    assert sched.abort_request("c") is not None
    assert [r.request_id for r in sched.waiting] == ["d"]
    out = run_step(sched)
    assert out.finished_request_ids == ("a", "c")  # c had been sent to the runner before
    assert plan(out) == [("b", 5, 1, True), ("d", 0, 1, True)]


def test_preemption_picks_the_youngest_by_arrival_not_the_last_admitted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("late", [1, 2, 3], arrival=5.0))  # admitted first, arrived last
    sched.add_request(make_request("early", [11, 12, 13], arrival=1.0))
    outs = run_steps(sched, 3)
    assert plan(outs[2]) == [("early", 4, 1, True)]
    assert outs[2].num_preempted == 1
    assert sched.requests["late"].status is RequestStatus.PREEMPTED
    assert outs[2].requests[0].block_table == (2, 3, 1)


def test_two_victims_in_one_step_wait_oldest_first() -> None:
    # b and c decode; a (older, admitted last) prefills in chunks and runs the pool dry.
    sched = make_scheduler(num_blocks=10, block_size=1, max_num_batched_tokens=6, max_model_len=10)
    sched.add_request(make_request("b", [11, 12], arrival=2.0, max_tokens=3))
    sched.add_request(make_request("c", [21, 22], arrival=3.0, max_tokens=3))
    run_step(sched)
    sched.add_request(make_request("a", tokens(1, 8), arrival=1.0, max_tokens=2))
    outs = run_steps(sched, 2)
    assert plan(outs[0]) == [("b", 2, 1, True), ("c", 2, 1, True), ("a", 0, 4, False)]
    # Step 3: b needs a page: c (youngest) goes; a's next chunk still does not fit: a goes too.
    assert plan(outs[1]) == [("b", 3, 1, True)]
    assert outs[1].num_preempted == 2
    assert [r.request_id for r in sched.waiting] == ["a", "c"]
    a, c = sched.waiting
    assert (a.output_token_ids, c.output_token_ids) == ([], [100, 101])
    assert sched.stats().num_used_blocks == 0  # b finished at step 3 too
    # a resumes first, from its four cached pages; c, whose pages were reused, recomputes.
    resumed = run_step(sched)
    assert plan(resumed) == [("a", 4, 4, True), ("c", 0, 2, False)]
    assert resumed.requests[0].block_table[:4] == (6, 7, 8, 9)
    assert a.num_cached_tokens == 0  # a resumption is not a first schedule
    for _ in range(10):
        run_step(sched)
    assert (a.output_token_ids, c.output_token_ids) == ([100, 101], [100, 101, 102])
    assert not sched.has_unfinished() and sched.stats().num_used_blocks == 0


# ---- model check: random workloads ---------------------------------------------------------------------
_HEAD = tokens(1, 8)
FAMILIES = [_HEAD + tokens(20, 16), _HEAD + tokens(60, 16), [5] * 24]
MAX_MODEL_LEN = 40  # 24-token prompts + a tail token + up to 12 outputs fit

arrival_strategy = st.tuples(
    st.integers(0, len(FAMILIES) - 1), st.integers(1, 24), st.integers(0, 2), st.integers(1, 3), st.integers(1, 12)
)
event_strategy = st.tuples(st.lists(arrival_strategy, max_size=3), st.none() | st.integers(0, 63), st.booleans())


class Workload:
    """Drives a scheduler like the engine does, and checks each step against an independent model
    of the KV pages (what every page slot holds) and of what the runner has been told."""

    def __init__(self, sched: Scheduler, rng: random.Random) -> None:
        self.sched = sched
        self.rng = rng
        self.kv: dict[int, list[int | None]] = {}
        self.sent: set[str] = set()
        self.reported: list[str] = []
        self.ended_after_sent: set[str] = set()
        self.next_id = 0
        self.clock = 0.0

    def arrive(self, family: int, length: int, tail: int, n: int, max_tokens: int) -> None:
        prompt = FAMILIES[family][:length] + ([300 + tail] if tail else [])
        self.clock += 1.0
        for _ in range(n):  # n samples share the prompt and the arrival time, as the engine makes them
            self.next_id += 1
            self.sched.add_request(make_request(f"r{self.next_id}", prompt, self.clock, max_tokens))

    def abort(self, index: int) -> None:
        live = sorted(self.sched.requests)
        if live:
            rid = live[index % len(live)]
            self.sched.abort_request(rid)
            if rid in self.sent:
                self.ended_after_sent.add(rid)

    def step(self, abort_mid_step: int | None) -> None:
        sched, bs = self.sched, self.sched.config.block_size
        before = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        self.reported += out.finished_request_ids
        scheduled = {sr.request_id for sr in out.requests}
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        preempted = [r for r in sched.waiting if r.request_id in before]
        assert len(preempted) == out.num_preempted
        for rid, remaining in before.items():  # no decode is skipped unless it was preempted
            assert remaining > 1 or rid in scheduled or sched.requests[rid].status is RequestStatus.PREEMPTED
        if out.num_preempted:  # nothing is admitted in a step that had to preempt
            assert scheduled <= set(before)
        for p in preempted:  # only the youngest go: every running request left behind is older
            assert all(r.arrival_time <= p.arrival_time for r in sched.running if r.request_id not in scheduled)
        for sr in out.requests:
            req = sched.requests[sr.request_id]
            assert (sr.new_request is not None) == (sr.request_id not in self.sent)
            self.sent.add(sr.request_id)
            assert sr.start_pos == req.num_computed_tokens and sr.block_table == tuple(req.block_table)
            assert sr.token_ids == tuple(req.token_slice(sr.start_pos, sr.seq_len))
            assert len(sr.block_table) == -(-sr.seq_len // bs) and sr.sample == (sr.seq_len == req.num_tokens)
            for pos in range(sr.start_pos, sr.seq_len):  # the step writes every new K/V first ...
                self.kv.setdefault(sr.block_table[pos // bs], [None] * bs)[pos % bs] = req.token_id(pos)
        for sr in out.requests:  # ... then each request must read exactly its own tokens
            req = sched.requests[sr.request_id]
            read = [self.kv[sr.block_table[p // bs]][p % bs] for p in range(sr.seq_len)]
            assert read == req.token_slice(0, sr.seq_len), f"{sr.request_id} reads another request's KV"
        self.check_pages({sr.request_id: sr.num_new_tokens for sr in out.requests})
        if abort_mid_step is not None:
            self.abort(abort_mid_step)
        sampled = {
            sr.request_id: EOS if self.rng.random() < 0.1 else self.rng.randrange(200, 210)
            for sr in out.requests
            if sr.sample
        }
        for r in sched.update(out, sampled):
            if r.is_finished:
                self.ended_after_sent.add(r.request_id)

    def check_pages(self, num_new: dict[str, int]) -> None:
        """Right after a schedule: each running request holds pages for exactly the tokens it will
        have computed; ref counts are the number of holders; only cached pages are shared."""
        bm = self.sched.block_manager
        bm.check_invariants()
        holders: Counter[int] = Counter()
        for r in self.sched.running:
            holders.update(r.block_table)
            assert len(r.block_table) == bm.num_blocks_for(r.num_computed_tokens + num_new.get(r.request_id, 0))
        assert all(not r.block_table for r in self.sched.waiting)
        assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)]
        for page, n in holders.items():
            assert n == 1 or bm.block_hash[page] is not None, f"page {page} shared without a cached hash"


@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    spare_pages=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(6, 32),
    events=st.lists(event_strategy, min_size=4, max_size=20),
    seed=st.integers(0, 1 << 16),
)
def test_random_workloads_hold_every_step_invariant_and_drain(
    block_size: int,
    spare_pages: int,
    max_num_seqs: int,
    budget: int,
    events: list[tuple[list[tuple[int, int, int, int, int]], int | None, bool]],
    seed: int,
) -> None:
    num_blocks = -(-MAX_MODEL_LEN // block_size) + spare_pages  # one longest request always fits
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
    )
    work = Workload(sched, random.Random(seed))
    for arrivals, abort_index, mid_step in events:
        for arrival in arrivals:
            work.arrive(*arrival)
        if abort_index is not None and not mid_step:
            work.abort(abort_index)
        work.step(abort_index if mid_step else None)
    for _ in range(500):  # every request ends: nothing livelocks under preemption
        if not sched.has_unfinished():
            break
        work.step(None)
    assert not sched.has_unfinished()
    work.reported += sched.schedule().finished_request_ids
    assert sorted(work.reported) == sorted(work.ended_after_sent)  # each exactly once
    assert sched.stats().num_used_blocks == 0 and sched.block_manager.ref_counts == [0] * num_blocks
