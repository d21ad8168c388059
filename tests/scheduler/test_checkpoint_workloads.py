"""Hybrid prefix caching under random workloads (shared heads, multi-turn continuations, aborts,
preemption, tiny page and checkpoint pools), checked step by step against an independent model of
what the engine's copies do: each state slot and checkpoint holds "the tokens its state has seen",
each KV page slot a token. Every request must start its step from a state that has seen exactly its
computed tokens, every kept state must be of the request's own tokens, and every request must read
exactly its own tokens from the KV pages (a restored partial page included)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import EOS, FAMILIES, make_request

MAX_MODEL_LEN = 48

arrival_strategy = st.tuples(
    st.integers(0, len(FAMILIES) - 1), st.integers(1, 24), st.integers(0, 2), st.integers(1, 6), st.booleans()
)
event_strategy = st.tuples(st.lists(arrival_strategy, max_size=3), st.none() | st.integers(0, 63), st.booleans())


class HybridModel:
    def __init__(self, sched: Scheduler, rng: random.Random) -> None:
        self.sched = sched
        self.rng = rng
        self.kv: dict[int, list[int | None]] = {}
        self.slots: dict[int, tuple[int, ...] | None] = {}
        self.checkpoints: dict[int, tuple[tuple[int, ...] | None, list[int | None] | None]] = {}
        self.finished: list[list[int]] = []  # token lists of ended sequences: later turns extend them
        self.next_id = 0
        self.clock = 0.0
        self.hits = 0

    def arrive(self, family: int, length: int, tail: int, max_tokens: int, continue_turn: bool) -> None:
        if continue_turn and self.finished:
            base = self.rng.choice(self.finished)[: MAX_MODEL_LEN - 10]
            prompt = base + [300 + tail]
        else:
            prompt = FAMILIES[family][:length] + ([300 + tail] if tail else [])
        self.clock += 1.0
        self.next_id += 1
        self.sched.add_request(make_request(f"r{self.next_id}", prompt, self.clock, max_tokens))

    def end(self, request: Request) -> None:
        self.finished.append(request.prompt_token_ids + request.output_token_ids)

    def abort(self, index: int) -> None:
        live = sorted(self.sched.requests)
        if live:
            request = self.sched.requests[live[index % len(live)]]
            self.sched.abort_request(request.request_id)
            self.end(request)

    def step(self) -> None:
        sched, bs = self.sched, self.sched.config.block_size
        out = sched.schedule()
        for save in out.state_saves:  # the runner: kept states first ...
            page = list(self.kv[save.kv_page]) if save.kv_page is not None else None
            self.checkpoints[save.checkpoint_id] = (self.slots[save.state_slot], page)
        for sr in out.requests:  # ... then restores ...
            req = sched.requests[sr.request_id]
            assert sr.state_slot is not None
            if sr.restore_checkpoint is not None:
                self.hits += 1
                state, page = self.checkpoints[sr.restore_checkpoint]
                self.slots[sr.state_slot] = state
                if sr.start_pos % bs:
                    assert page is not None, "a restore inside a page without its KV"
                    self.kv[sr.block_table[sr.start_pos // bs]] = list(page)
            elif sr.start_pos == 0:
                self.slots[sr.state_slot] = ()  # a fresh sequence's slot is zeroed
            assert self.slots[sr.state_slot] == tuple(req.token_slice(0, sr.start_pos)), (
                f"{sr.request_id} starts from another state"
            )
        for sr in out.requests:  # ... then the forward writes K/V and advances the states
            req = sched.requests[sr.request_id]
            for pos in range(sr.start_pos, sr.seq_len):
                self.kv.setdefault(sr.block_table[pos // bs], [None] * bs)[pos % bs] = req.token_id(pos)
            for save in sr.checkpoint_saves:
                assert save.num_tokens == sr.seq_len or save.num_tokens % bs == 0, "a kept state inside a page"
                page = list(self.kv[sr.block_table[save.num_tokens // bs]]) if save.num_tokens % bs else None
                self.checkpoints[save.checkpoint_id] = (tuple(req.token_slice(0, save.num_tokens)), page)
            assert sr.state_slot is not None
            self.slots[sr.state_slot] = tuple(req.token_slice(0, sr.seq_len))
        for sr in out.requests:
            req = sched.requests[sr.request_id]
            read = [self.kv[sr.block_table[p // bs]][p % bs] for p in range(sr.seq_len)]
            assert read == req.token_slice(0, sr.seq_len), f"{sr.request_id} reads another request's KV"
        sched.block_manager.check_invariants()
        assert sched.checkpoints is not None
        sched.checkpoints.check_invariants()
        sampled = {
            sr.request_id: EOS if self.rng.random() < 0.1 else self.rng.randrange(200, 210)
            for sr in out.requests
            if sr.sample
        }
        for request in sched.update(out, sampled):
            if request.is_finished:
                self.end(request)


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
    num_slots=st.integers(1, 4),
    num_checkpoints=st.integers(1, 6),
    bits=st.integers(0, 3),
    budget=st.integers(6, 32),
    events=st.lists(event_strategy, min_size=4, max_size=24),
    seed=st.integers(0, 1 << 16),
)
def test_random_hybrid_workloads_restore_exactly_their_own_states(
    block_size: int,
    spare_pages: int,
    num_slots: int,
    num_checkpoints: int,
    bits: int,
    budget: int,
    events: list[tuple[list[tuple[int, int, int, int, bool]], int | None, bool]],
    seed: int,
) -> None:
    num_blocks = -(-MAX_MODEL_LEN // block_size) + spare_pages  # one longest request always fits
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_slots,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            block_size=block_size,
            num_blocks=num_blocks,
            num_state_slots=num_slots,
            num_state_checkpoints=num_checkpoints,
            state_checkpoint_bits=bits,
        )
    )
    model = HybridModel(sched, random.Random(seed))
    for arrivals, abort_index, before_step in events:
        for arrival in arrivals:
            model.arrive(*arrival)
        if abort_index is not None and before_step:
            model.abort(abort_index)
        if sched.has_unfinished():
            model.step()
        if abort_index is not None and not before_step:
            model.abort(abort_index)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        model.step()
    assert not sched.has_unfinished()
    ck = sched.checkpoints
    assert ck is not None and ck.num_used + ck.num_free == num_checkpoints
    assert sched.stats().num_used_blocks == 0 and sched.block_manager.ref_counts == [0] * num_blocks
    sched.reset_prefix_cache()
    assert ck.num_free == num_checkpoints


def test_the_random_workloads_do_hit() -> None:
    """The model check above is only worth something if restores happen in it."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=MAX_MODEL_LEN,
            block_size=2,
            num_blocks=60,
            num_state_slots=2,
            num_state_checkpoints=6,
            state_checkpoint_bits=2,
        )
    )
    model = HybridModel(sched, random.Random(0))
    for i in range(12):
        model.arrive(i % 2, 20, 0, 4, continue_turn=i % 3 == 2)
        while sched.has_unfinished():
            model.step()
    assert model.hits >= 8
