"""The persistent InputBatch builds exactly what build_forward_batch does, step after step: through
chunked prefills, decodes, drafts, prefix-cache hits, preemption (a request's pages replaced) and
finished requests' rows reused."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.batch import ForwardBatch, build_forward_batch
from engine.input_batch import InputBatch
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.factories import make_request

CPU = torch.device("cpu")
TENSORS = (
    "input_ids",
    "positions",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "slot_mapping",
    "logits_indices",
)


def assert_same(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in TENSORS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.tolist() == w.tolist(), name
    for name in (
        "query_lens",
        "seq_lens",
        "block_size",
        "request_ids",
        "sample_request_ids",
        "state_slots",
        "interior_saves",
    ):
        assert getattr(got, name) == getattr(want, name), name


@pytest.mark.parametrize("num_blocks", [9, 64])  # 9: pages run short and requests are preempted
def test_every_step_of_a_scheduled_workload_matches_the_pure_builder(num_blocks: int) -> None:
    bs = 4
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=10, max_model_len=40, block_size=bs, num_blocks=num_blocks
        )
    )
    # Rows for 4 requests: preempted ones keep theirs until a new request needs one.
    batch = InputBatch(max_num_seqs=4, max_num_tokens=10, max_pages_per_seq=10, block_size=bs, device=CPU)
    shared = list(range(1, 9))  # two full pages: later requests hit them in the prefix cache
    ids = itertools.count()
    for i in range(6):
        s.add_request(make_request(f"r{i}", shared + [50 + i] * (i + 1), max_tokens=10 + i, ignore_eos=True))
    num_preempted = 0
    while s.has_unfinished():
        out = s.schedule()
        num_preempted += out.num_preempted
        if out.is_empty:
            continue
        assert_same(batch.build(out), build_forward_batch(out, bs, CPU))
        s.update(out, {r.request_id: 100 + next(ids) % 300 for r in out.requests if r.sample})
    assert (num_preempted > 0) == (num_blocks == 9)


def test_draft_rows_and_a_trimmed_table_match_the_pure_builder() -> None:
    batch = InputBatch(max_num_seqs=2, max_num_tokens=16, max_pages_per_seq=8, block_size=4, device=CPU)

    def step(*reqs: ScheduledRequest) -> None:
        out = SchedulerOutput(tuple(reqs), ())
        assert_same(batch.build(out), build_forward_batch(out, 4, CPU))

    step(ScheduledRequest("a", (1, 2, 3, 4, 5, 6), 0, (7, 3), True), ScheduledRequest("b", (9, 8, 7), 0, (5,), True))
    # "a" verifies 3 drafts over a new page; "b" decodes.
    step(
        ScheduledRequest("a", (10, 11, 12, 13), 6, (7, 3, 2), True, num_draft_tokens=3),
        ScheduledRequest("b", (20,), 3, (5,), True),
    )
    # Drafts rejected: page 2 went back and "a" now has page 6 there.
    step(ScheduledRequest("a", (14, 15, 16), 7, (7, 3, 6), True, num_draft_tokens=2))


def test_a_request_back_from_preemption_has_its_row_rewritten() -> None:
    """Back with a prefix hit on other pages: the pages before its start are new too."""
    batch = InputBatch(max_num_seqs=2, max_num_tokens=16, max_pages_per_seq=8, block_size=4, device=CPU)

    def step(*reqs: ScheduledRequest) -> None:
        out = SchedulerOutput(tuple(reqs), ())
        assert_same(batch.build(out), build_forward_batch(out, 4, CPU))

    step(ScheduledRequest("a", (1, 2, 3, 4, 5, 6), 0, (7, 3), True, resumed=True))
    step(ScheduledRequest("a", (8, 9, 10), 4, (9, 3, 5), True, resumed=True))
