"""State slots of hybrid models: the slot manager alone (exact ids), and the scheduler owning slots
as it owns pages: admission waits for a slot, finish / abort / preemption give it back, and every
scheduled request carries the slot it holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.slot_manager import SlotManager


def request(request_id: str, n: int = 3, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(request_id, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def hybrid_scheduler(num_slots: int, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=256,
            block_size=4,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            num_state_slots=num_slots,
        )
    )


def step(sched: Scheduler) -> dict[str, int | None]:
    """Schedule, check each request carries its slot, feed token 7 back; request id -> slot."""
    out = sched.schedule()
    slots = {}
    for sr in out.requests:
        held = sched.requests[sr.request_id].state_slot
        assert sr.state_slot is not None and sr.state_slot == held
        slots[sr.request_id] = sr.state_slot
    assert len(set(slots.values())) == len(slots), "two running requests share a slot"
    sched.update(out, {sr.request_id: 7 for sr in out.requests if sr.sample})
    return slots


def test_lowest_free_slot_goes_first_and_returns() -> None:
    m = SlotManager(3)
    a, b, c, d = (request(x) for x in "abcd")
    assert [m.allocate(r) for r in (a, b, c)] == [True, True, True]
    assert (a.state_slot, b.state_slot, c.state_slot) == (0, 1, 2)
    assert not m.allocate(d) and d.state_slot is None
    m.free(b)
    assert b.state_slot is None and m.num_free_slots == 1
    assert m.allocate(d) and d.state_slot == 1
    assert m.allocate(d) and d.state_slot == 1  # holding one already: keeps it
    m.free(a)
    m.free(a)  # a second free of a request without a slot is a no-op
    assert m.num_used_slots == 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_slots_are_never_shared_and_always_the_lowest_free(ops: list[tuple[bool, int]]) -> None:
    m = SlotManager(4)
    reqs = [request(f"r{i}") for i in range(6)]
    held: dict[int, int] = {}  # request index -> slot (the model)
    for allocate, i in ops:
        r = reqs[i]
        if allocate:
            free = sorted(set(range(4)) - set(held.values()))
            ok = m.allocate(r)
            if i in held:
                assert ok and r.state_slot == held[i]
            elif free:
                assert ok and r.state_slot == free[0]
                held[i] = free[0]
            else:
                assert not ok and r.state_slot is None
        else:
            m.free(r)
            held.pop(i, None)
            assert r.state_slot is None
        assert m.num_used_slots == len(held)


def test_admission_waits_for_a_free_slot_and_finishing_frees_it() -> None:
    sched = hybrid_scheduler(num_slots=2)
    for i, rid in enumerate("abc"):
        sched.add_request(request(rid, max_tokens=2, arrival=i))
    assert step(sched) == {"a": 0, "b": 1}  # prefill; c waits: no slot although pages and budget remain
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert step(sched) == {"a": 0, "b": 1}  # decode; both reach max_tokens=2 and finish
    assert step(sched) == {"c": 0}
    assert sched.slots is not None and sched.slots.num_used_slots == 1


def test_abort_frees_the_slot_for_the_next_request() -> None:
    sched = hybrid_scheduler(num_slots=1)
    sched.add_request(request("a", max_tokens=50, arrival=0))
    sched.add_request(request("b", max_tokens=50, arrival=1))
    assert step(sched) == {"a": 0}
    sched.abort_request("a")
    assert step(sched) == {"b": 0}


def test_preemption_frees_the_slot_and_the_victim_recomputes_with_a_fresh_one() -> None:
    # 4 pages of 4 tokens: two 6-token prompts fit (2 pages each), growing past 8 tokens does not.
    sched = hybrid_scheduler(num_slots=2, num_blocks=4)
    sched.add_request(request("old", n=6, max_tokens=20, arrival=0))
    sched.add_request(request("young", n=6, max_tokens=20, arrival=1))
    assert step(sched) == {"old": 0, "young": 1}
    seen: list[dict[str, int | None]] = []
    while sched.num_preemptions == 0:
        seen.append(step(sched))
    young = next(r for r in sched.waiting if r.request_id == "young")
    assert young.status is RequestStatus.PREEMPTED and young.state_slot is None and young.num_computed_tokens == 0
    assert sched.slots is not None and sched.slots.num_used_slots == 1


def test_prefix_caching_with_state_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        SchedulerConfig(num_state_slots=4, enable_prefix_caching=True)
