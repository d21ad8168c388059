"""Hybrid prefix caching's bookkeeping (scheduler/checkpoint_manager.py, with the scheduler and the
block manager): where snapshots are taken, which checkpoint a request restores and with which pages,
eviction in step with the KV pages, and no checkpoint id lost to aborts or preemption. Exact ids,
driven with fake sampled tokens."""

from __future__ import annotations

import pytest

from scheduler.checkpoint_manager import grid_bits_for, on_grid
from scheduler.output import CheckpointSave, SchedulerOutput, StateSave
from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import make_request, run_step, tokens


def hybrid_scheduler(
    num_blocks: int = 32,
    block_size: int = 4,
    slots: int = 2,
    checkpoints: int = 4,
    bits: int = 0,
    budget: int = 64,
    **kwargs: int,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=slots,
            max_num_batched_tokens=budget,
            max_model_len=256,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=True,
            num_state_slots=slots,
            num_state_checkpoints=checkpoints,
            state_checkpoint_bits=bits,
            **kwargs,
        )
    )


def finish(sched: Scheduler, request: Request) -> list[SchedulerOutput]:
    sched.add_request(request)
    outs = []
    while request.request_id in sched.requests:
        outs.append(run_step(sched))
    return outs


def scheduled(out: SchedulerOutput, request_id: str) -> object:
    return next(sr for sr in out.requests if sr.request_id == request_id)


def test_grid_page_counts_have_few_significant_bits() -> None:
    assert [n for n in range(1, 40) if on_grid(n, 2)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert [n for n in range(1, 40) if on_grid(n, 1)] == [1, 2, 4, 8, 16, 32]
    assert not any(on_grid(n, 0) for n in range(1, 40))
    assert grid_bits_for(40, 10) == 2 and grid_bits_for(40, 6) == 1 and grid_bits_for(40, 5) == 0


def test_a_prompt_keeps_its_state_at_its_end_and_the_next_turn_restores_the_finished_sequence() -> None:
    sched = hybrid_scheduler()
    first = finish(sched, make_request("a", tokens(1, 9), 0.0, max_tokens=3))
    assert scheduled(first[0], "a").checkpoint_saves == (CheckpointSave(0, 9),)  # the prompt's end
    a_pages = list(scheduled(first[-1], "a").block_table)
    # Finished after computing 11 tokens (9 + 2 decodes; the third output never ran): queued.
    turn2 = make_request("b", tokens(1, 9) + [100, 101, 102, 7, 7], 1.0, max_tokens=2)
    sched.add_request(turn2)
    out = run_step(sched)
    assert out.state_saves == (StateSave(1, 0, a_pages[2]),)  # slot 0, the partial page 2 (8..10)
    sr = scheduled(out, "b")
    assert (sr.restore_checkpoint, sr.start_pos, sr.token_ids) == (1, 11, (102, 7, 7))
    # The full pages are shared; the partial one is b's own. It is a's old partial page, reused first
    # since no one can hit it: safe, as a step copies its saves before its restores.
    assert sr.block_table[:2] == tuple(a_pages[:2]) and sr.block_table[2] == a_pages[2]
    assert [sched.block_manager.ref_counts[p] for p in sr.block_table] == [1, 1, 1, 1]
    assert turn2.num_cached_tokens == 11 and sched.stats().prefix_cache_hit_tokens == 11


def test_a_rewritten_history_restores_only_what_it_shares() -> None:
    sched = hybrid_scheduler(bits=1)  # grid: 1, 2, 4, ... pages
    finish(sched, make_request("a", tokens(1, 14), 0.0, max_tokens=2))
    # The answer dropped from the history (a template's thinking removal): the prompt's end hits.
    same_prompt = make_request("b", tokens(1, 14) + [55, 56], 1.0, max_tokens=1)
    out = finish(sched, same_prompt)[0]
    assert (scheduled(out, "b").restore_checkpoint, same_prompt.num_cached_tokens) == (2, 14)  # 0, 1: grid at 4, 8
    # A change inside the prompt: only the grid point before it (2 pages = 8 tokens).
    edited = make_request("c", tokens(1, 10) + [77] + tokens(12, 3), 2.0, max_tokens=1)
    finish(sched, edited)
    assert edited.num_cached_tokens == 8
    # A change in the first page: nothing.
    first_page = make_request("d", [9] + tokens(2, 13), 3.0, max_tokens=1)
    assert scheduled(finish(sched, first_page)[0], "d").restore_checkpoint is None and first_page.num_cached_tokens == 0


def test_a_checkpoint_is_restorable_only_after_the_step_that_writes_it() -> None:
    sched = hybrid_scheduler()
    a = make_request("a", tokens(1, 9), 0.0, max_tokens=2)
    sched.add_request(a)
    out = sched.schedule()
    probe = make_request("p", tokens(1, 9) + [5], 1.0)
    sched.block_manager.find_cached_prefix(probe)
    assert sched.checkpoints is not None and sched.checkpoints.find(probe, 2) is None  # pending
    sched.update(out, {"a": 100})
    found = sched.checkpoints.find(probe, 2)
    assert found is not None and found.checkpoint_id == 0


def test_a_shared_prefix_restores_below_it_once_then_at_the_junction() -> None:
    sched = hybrid_scheduler(bits=1, checkpoints=8)
    head = tokens(1, 24)  # 6 pages; the grid has 1, 2 and 4 pages in it
    first = finish(sched, make_request("a", head + [50, 51, 52], 0.0, max_tokens=1))
    assert [s.num_tokens for s in scheduled(first[0], "a").checkpoint_saves] == [4, 8, 16, 27]
    b = make_request("b", head + [60, 61, 62], 1.0, max_tokens=1)
    out = finish(sched, b)[0]
    sr = scheduled(out, "b")
    # The last grid point in the shared head, then a snapshot where the cached pages end.
    assert (sr.restore_checkpoint, sr.start_pos, b.num_cached_tokens) == (2, 16, 16)
    assert sr.checkpoint_saves == (CheckpointSave(4, 24), CheckpointSave(5, 27))
    c = make_request("c", head + [70, 71], 2.0, max_tokens=1)
    out = finish(sched, c)[0]
    assert (scheduled(out, "c").restore_checkpoint, c.num_cached_tokens) == (4, 24)


def test_grid_snapshots_are_evicted_before_prompt_ends_and_sequence_ends() -> None:
    sched = hybrid_scheduler(bits=1, checkpoints=3)
    finish(sched, make_request("a", tokens(1, 10), 0.0, max_tokens=1))  # grid 4, 8; prompt end 10
    ck = sched.checkpoints
    assert ck is not None and ck.num_free == 0
    # b's prompt end needs an id: the oldest grid snapshot goes (4 tokens), not a's prompt end.
    finish(sched, make_request("b", [90] * 6, 1.0, max_tokens=1))  # grid 4 (new key) and prompt end 6
    assert ck.num_evicted == 2
    again = make_request("c", tokens(1, 10) + [5], 2.0, max_tokens=1)
    finish(sched, again)
    assert again.num_cached_tokens == 10


def test_an_evicted_page_drops_the_checkpoints_that_need_it() -> None:
    sched = hybrid_scheduler(num_blocks=6, slots=1)
    finish(sched, make_request("a", tokens(1, 9), 0.0, max_tokens=1))  # pages 0..2; checkpoint at 9
    ck = sched.checkpoints
    assert ck is not None and ck.num_used == 1
    # 24 other tokens need every page: a's cached pages are reused and its checkpoint goes with them.
    finish(sched, make_request("b", [90] * 23, 1.0, max_tokens=1))
    assert ck.num_invalidated == 1
    ck.check_invariants()
    c = make_request("c", tokens(1, 9) + [5], 2.0, max_tokens=1)
    finish(sched, c)
    assert c.num_cached_tokens == 0


def test_pages_no_checkpoint_needs_are_evicted_first() -> None:
    sched = hybrid_scheduler(num_blocks=16, slots=1, checkpoints=1)
    a_pages = list(scheduled(finish(sched, make_request("a", tokens(1, 12), 0.0, max_tokens=1))[0], "a").block_table)
    bm = sched.block_manager
    assert len(a_pages) == 3 and set(a_pages).isdisjoint(list(bm.free_queue)[:13])  # its checkpoint needs them
    # b's prompt end takes the only checkpoint: a's pages are of no use now, and go first (with b's
    # partial page, which no one can hit).
    b_pages = list(scheduled(finish(sched, make_request("b", [90] * 5, 1.0, max_tokens=1))[0], "b").block_table)
    assert list(bm.free_queue)[:4] == [b_pages[1]] + sorted(a_pages, key=list(bm.free_queue).index)
    assert set(list(bm.free_queue)[1:4]) == set(a_pages)


@pytest.mark.parametrize("how", ["abort", "preempt", "fail"])
def test_aborts_and_preemption_never_lose_a_checkpoint(how: str) -> None:
    # 10 pages of 4 tokens: a (30 tokens) and b (22) do not fit together, so one is preempted.
    sched = hybrid_scheduler(num_blocks=10 if how == "preempt" else 32, checkpoints=3, bits=2, budget=8)
    a = make_request("a", tokens(1, 20), 0.0, max_tokens=10)
    b = make_request("b", tokens(40, 12), 1.0, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    ck = sched.checkpoints
    assert ck is not None
    while a.num_output_tokens < 2:
        run_step(sched)
        ck.check_invariants()
    if how == "abort":
        slot = a.state_slot
        sched.abort_request("a")  # its state, after 21 tokens, goes with the next step
        assert [(s.state_slot, s.kv_page is not None) for s in run_step(sched).state_saves] == [(slot, True)]
    if how == "fail":  # after a failed step: nothing of the suspect states is kept
        for rid in list(sched.requests):
            sched.abort_request(rid, keep_state=False)
        sched.reset_prefix_cache()
        assert ck.num_free == 3 and not sched.schedule().state_saves
        return
    while sched.has_unfinished():
        run_step(sched)
        ck.check_invariants()
    if how == "preempt":
        assert sched.num_preemptions > 0
    assert ck.num_used + ck.num_free == 3 and sched.block_manager.num_used_blocks == 0
    sched.reset_prefix_cache()
    assert ck.num_free == 3


def test_a_preempted_sequence_resumes_from_its_own_state() -> None:
    # 4 pages of 4 tokens. a (7-token prompt) and b (5) take two each; a's third decode needs a page.
    sched = hybrid_scheduler(num_blocks=4, checkpoints=8)
    a = make_request("a", tokens(1, 7), 0.0, max_tokens=3)
    b = make_request("b", tokens(50, 5), 1.0, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    b_pages = list(scheduled(run_step(sched), "b").block_table)
    run_step(sched)
    preempting = run_step(sched)
    assert preempting.num_preempted == 1 and b.num_computed_tokens == 0
    # b had computed 6 tokens: its state is kept with its partial page's KV, copied before this step
    # reuses that page for a (checkpoints 0 and 1 are the prompts' ends).
    assert preempting.state_saves == (StateSave(2, 1, b_pages[1]),)
    assert scheduled(preempting, "a").block_table[2] == b_pages[1]
    resumed = scheduled(run_step(sched), "b")  # a finished: b resumes
    assert (resumed.restore_checkpoint, resumed.start_pos, resumed.token_ids) == (2, 6, (101,))
    while sched.has_unfinished():
        run_step(sched)
    assert b.output_token_ids == [100 + i for i in range(8)]


def test_a_step_that_verifies_drafts_keeps_no_state() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=64,
            max_model_len=256,
            block_size=4,
            num_blocks=32,
            num_state_slots=2,
            num_state_checkpoints=8,
            state_checkpoint_bits=6,
            num_speculative_tokens=3,
            speculative_max_batch=4,
        ),
        drafter=lambda request_id, context, k: [7] * k,
    )
    sched.add_request(make_request("a", tokens(1, 7), 0.0, max_tokens=12))
    outs = []
    for _ in range(3):
        out = sched.schedule()
        sr = scheduled(out, "a")
        sched.update(out, {"a": list(sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :]) + [100]})
        outs.append(sr)
    assert outs[0].checkpoint_saves == (CheckpointSave(0, 4), CheckpointSave(1, 7))
    # Every page boundary is on this grid, and the verify steps cross 8 and 12: no state kept, as a
    # verify step's state may hold rejected drafts.
    assert [(sr.start_pos, sr.num_draft_tokens, sr.checkpoint_saves) for sr in outs[1:]] == [(7, 3, ()), (11, 3, ())]


def test_a_request_whose_prefix_is_being_computed_waits_a_step_and_restores_it() -> None:
    sched = hybrid_scheduler(bits=1, checkpoints=8, slots=3)
    head = tokens(1, 24)
    a = make_request("a", head + [50, 51], 0.0, max_tokens=1)
    b = make_request("b", head + [60], 0.0, max_tokens=1)
    c = make_request("c", [90] * 5, 0.0, max_tokens=1)  # shares nothing: not held back
    for r in (a, b, c):
        sched.add_request(r)
    first = run_step(sched)
    assert [sr.request_id for sr in first.requests] == ["a", "c"] and sched.waiting[0] is b
    second = run_step(sched)
    sr = scheduled(second, "b")
    # a's grid snapshot after 4 pages (a kept 0-3, c 4-5), then b computes to the junction (a's 6
    # pages) and its prompt's end, keeping both.
    assert (sr.restore_checkpoint, sr.start_pos) == (2, 16)
    assert sr.checkpoint_saves == (CheckpointSave(6, 24), CheckpointSave(7, 25))
    assert b.num_cached_tokens == 16
