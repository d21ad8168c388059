"""KV events of a hybrid model (engine/cache_events/snapshot_gate.py): a prefix hit there needs the
DeltaNet state snapshot at its end, so a page is announced (BlockStored) only once it is cached AND
some snapshot's chain needs it, and withdrawn (BlockRemoved) when the last such snapshot goes, even
while the page itself stays cached. Driven through the real scheduler, with vLLM's hashes."""

from __future__ import annotations

from engine.cache_events.kv_event_hashes import ExternalBlockHashes
from engine.cache_events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from engine.cache_events.snapshot_gate import SnapshotGate
from scheduler.scheduler import Scheduler
from tests import vllm_kv_events as vllm
from tests.scheduler.test_checkpoint_manager import finish, hybrid_scheduler
from tests.scheduler.test_scheduler import make_request, run_step, tokens

BS = 4
SEED = "0"


def gated(sched: Scheduler) -> KVEventRecorder:
    """Wire the gate as the engine core does with KV events on; the recorder it feeds."""
    recorder = KVEventRecorder(BS, ExternalBlockHashes(BS, hash_seed=SEED))
    gate = SnapshotGate(recorder)
    sched.block_manager.event_sink = gate
    assert sched.checkpoints is not None
    sched.checkpoints.page_sink = gate
    return recorder


def stored(events: list[object]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(events: list[object]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_pages_of_a_chunked_prefill_are_announced_only_with_the_snapshot_at_its_end() -> None:
    sched = hybrid_scheduler(budget=8, bits=0)  # no grid: the one snapshot is at the prompt's end
    recorder = gated(sched)
    prompt = tokens(1, 18)
    sched.add_request(make_request("a", prompt, 0.0, max_tokens=1))
    run_step(sched)  # tokens 0..7: pages 0 and 1 enter the prefix cache, no state is kept there
    assert len(sched.block_manager.cached) == 2
    assert recorder.take() == []
    run_step(sched)  # 8..15: pages 2, 3
    assert len(sched.block_manager.cached) == 4 and recorder.take() == []
    run_step(sched)  # 16, 17: the prompt's end, its snapshot needs pages 0..3 (and keeps 16, 17 itself)
    events = recorder.take()
    assert [type(e) for e in events] == [BlockStored]
    [event] = events
    assert event.block_hashes == vllm.vllm_block_hashes(prompt[:16], BS, SEED)
    assert event.parent_block_hash is None and event.token_ids == prompt[:16]


def test_a_page_is_withdrawn_when_the_last_snapshot_needing_it_goes() -> None:
    sched = hybrid_scheduler(num_blocks=16, slots=1, checkpoints=1)
    recorder = gated(sched)
    finish(sched, make_request("a", tokens(1, 12), 0.0, max_tokens=1))  # its snapshot at 12 needs pages 0..2
    a_hashes = vllm.vllm_block_hashes(tokens(1, 12), BS, SEED)
    assert stored(recorder.take()) == a_hashes
    # b's prompt end takes the only snapshot: a's pages are still cached, but no hit can use them.
    finish(sched, make_request("b", [90] * 5, 1.0, max_tokens=1))
    events = recorder.take()
    assert sorted(removed(events)) == sorted(a_hashes)
    assert stored(events) == vllm.vllm_block_hashes([90] * 4, BS, SEED)
    assert len(sched.block_manager.cached) == 4  # a's 3 pages and b's first
    # A page that was never announced leaves the cache without a word; a reset says AllBlocksCleared.
    sched.reset_prefix_cache()
    events = recorder.take()
    assert removed(events) == vllm.vllm_block_hashes([90] * 4, BS, SEED)
    assert isinstance(events[-1], AllBlocksCleared)


def test_a_snapshot_on_pages_already_cached_announces_them_then() -> None:
    sched = hybrid_scheduler(budget=8, bits=0)
    recorder = gated(sched)
    sched.add_request(make_request("a", tokens(1, 18), 0.0, max_tokens=1))
    run_step(sched)  # pages 0, 1 cached, nothing said
    assert recorder.take() == []
    sched.abort_request("a")  # its slot's state after 8 tokens is kept: a snapshot on pages 0, 1
    run_step(sched)
    assert stored(recorder.take()) == vllm.vllm_block_hashes(tokens(1, 8), BS, SEED)
