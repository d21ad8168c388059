"""The host tier's bookkeeping (scheduler/host_tier.py) without a model: exact device pages and host
slots of the spills a device eviction orders and the loads a prefix hit orders, pinning, LRU order,
snapshots that live only while their pages are in a tier, a reset, the KV events' medium, and the
flag's bounds."""

from __future__ import annotations

import math

import pytest

from engine.attention.host_pool import split_budget
from engine.cache_events.kv_event_hashes import ExternalBlockHashes
from engine.cache_events.kv_events import KVEventRecorder
from engine.config import EngineConfig
from engine.errors import ConfigError
from scheduler.block_manager import ROOT_HASH, BlockManager, hash_block
from scheduler.host_tier import HostTier
from scheduler.output import PageCopy, SnapshotSpill
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(request_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks: int = 4, num_host_pages: int = 3) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BS,
            max_model_len=64,
            max_num_batched_tokens=64,
            num_host_pages=num_host_pages,
        )
    )


def run_to_end(s: Scheduler, request: Request) -> tuple:
    """Add the request and step it until it finishes (one sampled token per step); the first step's output."""
    s.add_request(request)
    first = None
    while request.request_id in s.requests:
        out = s.schedule()
        first = first or out
        s.update(out, {r.request_id: 7 for r in out.requests if r.sample})
    return first


def page_hashes(tokens: list[int], n: int) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return hashes


def test_an_evicted_cached_page_is_spilled_before_the_step_reuses_it() -> None:
    s = make_scheduler()
    a = list(range(1, 10))  # 2 full pages + 1 token: pages 0, 1 cached
    run_to_end(s, make_request("a", a))
    out = run_to_end(s, make_request("b", list(range(100, 116))))  # 4 pages: takes 3, 2, then evicts 1, 0
    assert out.host_copies.page_spills == (PageCopy(1, 0), PageCopy(0, 1))
    assert out.host_copies.page_loads == ()
    h0, h1 = page_hashes(a, 2)
    assert s.host is not None and dict(s.host.pages) == {h1: 0, h0: 1}
    s.host.check_invariants()
    s.block_manager.check_invariants()


def test_a_prefix_hit_continues_into_host_pages_loaded_into_fresh_pages_while_pinned_slots_stay() -> None:
    s = make_scheduler()
    a = list(range(1, 10))
    run_to_end(s, make_request("a", a))
    run_to_end(s, make_request("b", list(range(100, 116))))  # a's pages now in host slots 1 (h0) and 0 (h1)
    c = make_request("c", a + [50])
    out = run_to_end(s, c)
    copies = out.host_copies
    # b's four cached pages are evicted for c's three: the host's two other slots are pinned (c loads
    # from them), so each spill takes slot 2, evicting the spill before it.
    assert copies.page_spills == (PageCopy(0, 2), PageCopy(1, 2), PageCopy(2, 2))
    assert copies.page_loads == (PageCopy(0, 1), PageCopy(1, 0))
    assert c.num_cached_tokens == 8
    [sr] = out.requests
    assert (sr.start_pos, sr.token_ids) == (8, (9, 50))
    assert s.host is not None and (s.host.num_loaded_pages, s.host.num_hit_tokens) == (2, 8)
    s.host.check_invariants()
    s.block_manager.check_invariants()


def test_a_page_loaded_back_is_most_recently_used_and_not_spilled_twice() -> None:
    device: set[bytes] = set()
    host = HostTier(2, 0, BS, device.__contains__)
    h = page_hashes(list(range(12)), 3)
    assert host.spill_page(h[0], 5) and host.spill_page(h[1], 6)
    req = make_request("r", list(range(12)) + [1])
    req.block_table = [9, 8, 7, 6]
    BlockManager(1, BS).extend_hashes(req, 12)
    hit = host.lookup(req, 0, hybrid=False)
    assert hit.host_slots == (0, 1)
    host.load_pages(req, 0, (0,))  # h0 back on the device: now the most recently used
    assert host.spill_page(h[0], 9)  # evicted again: the host copy stands, no second copy
    copies = host.take_copies()
    assert copies.page_spills == (PageCopy(5, 0), PageCopy(6, 1))
    assert copies.page_loads == (PageCopy(9, 0),)
    assert host.spill_page(h[2], 4)  # full: the least recently used (h1, slot 1) goes
    assert dict(host.pages) == {h[0]: 0, h[2]: 1}
    host.check_invariants()


def test_a_snapshot_stays_only_while_every_page_of_its_chain_is_in_a_tier() -> None:
    device: set[bytes] = set()
    host = HostTier(2, 2, BS, device.__contains__)
    h = page_hashes(list(range(16)), 4)
    device.add(h[1])
    host.spill_page(h[0], 3)
    host.spill_snapshot(11, (h[0], h[1]), (5, 6))  # h0 on the host, h1 on the device
    host.spill_snapshot(12, (h[0], h[1], h[2]), ())  # h2 in neither: not kept
    assert host.take_copies().snapshot_spills == (SnapshotSpill(11, 0),)
    assert host.num_used_snapshots == 1
    device.discard(h[1])
    host.page_gone(h[1])  # the device evicted h1 with no host copy
    assert host.num_used_snapshots == 0
    host.spill_snapshot(13, (h[0],), ())
    host.spill_page(h[2], 1)
    host.spill_page(h[3], 2)  # evicts h0 (least recently used), which the device does not hold
    assert host.num_used_snapshots == 0 and h[0] not in host.pages
    host.check_invariants()


def test_a_reset_forgets_every_page_and_snapshot() -> None:
    device: set[bytes] = set()
    host = HostTier(2, 1, BS, device.__contains__)
    h = page_hashes(list(range(8)), 2)
    host.spill_page(h[0], 0)
    host.spill_snapshot(3, (h[0],), ())
    host.reset()
    assert (host.num_used_pages, host.num_used_snapshots) == (0, 0)
    assert host.take_copies().is_empty
    host.check_invariants()


def test_kv_events_say_the_host_tier_holds_a_page_with_vllms_cpu_medium() -> None:
    s = make_scheduler(num_host_pages=1)
    recorder = KVEventRecorder(BS, ExternalBlockHashes(BS, hash_seed="0"))
    s.block_manager.event_sink = recorder
    assert s.host is not None
    s.host.event_sink = recorder
    run_to_end(s, make_request("a", list(range(1, 6))))  # 1 full page, cached
    stored = recorder.take()
    assert [(type(e).__name__, e.medium) for e in stored] == [("BlockStored", "GPU")]
    run_to_end(s, make_request("b", list(range(100, 116))))  # evicts a's page: host takes it
    events = recorder.take()
    kinds = [(type(e).__name__, e.medium) for e in events]
    assert kinds[:2] == [("BlockStored", "CPU"), ("BlockRemoved", "GPU")]
    assert events[0].block_hashes == events[1].block_hashes == stored[0].block_hashes
    assert (events[0].token_ids, events[0].parent_block_hash, events[0].block_size) == ([], None, BS)
    run_to_end(s, make_request("c", list(range(200, 216))))  # b's pages evicted: the host's one slot changes hands
    cpu = [(type(e).__name__, e.block_hashes) for e in recorder.take() if e.medium == "CPU"]
    assert cpu[0] == ("BlockRemoved", stored[0].block_hashes)


@pytest.mark.parametrize("size", [-1.0, math.inf, math.nan])
def test_the_flag_takes_only_a_finite_non_negative_size(size: float) -> None:
    with pytest.raises(ConfigError, match="--kv-offloading-size"):
        EngineConfig(kv_offloading_size=size)


def test_the_flag_is_declared_with_help_and_maps_onto_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli import build_parser, server_config

    parser = build_parser(["serve"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "--kv-offloading-size GiB" in capsys.readouterr().out
    args = parser.parse_args(["serve", "--kv-offloading-size", "2.5"])
    assert server_config(args).engine.kv_offloading_size == 2.5
    assert server_config(parser.parse_args(["serve"])).engine.kv_offloading_size == 0.0


def test_snapshots_take_the_share_of_the_budget_checkpoints_take_on_the_device() -> None:
    # device: 3000 bytes of pages, 1000 of checkpoints -> a quarter of the host budget for snapshots
    assert split_budget(
        4000, page_bytes=100, snapshot_bytes=250, device_kv_bytes=3000, device_checkpoint_bytes=1000
    ) == (30, 4)
    assert split_budget(1000, page_bytes=100, snapshot_bytes=0, device_kv_bytes=3000, device_checkpoint_bytes=0) == (
        10,
        0,
    )


def test_a_restarted_engine_carries_on_the_host_counters_with_an_empty_tier() -> None:
    s = make_scheduler()
    run_to_end(s, make_request("a", list(range(1, 10))))
    run_to_end(s, make_request("b", list(range(100, 116))))
    last = s.stats()
    assert last.host is not None and last.host.spilled_pages == 2
    successor = make_scheduler()
    successor.restore(last)
    host = successor.stats().host
    assert host is not None and (host.spilled_pages, host.num_used_pages) == (2, 0)
    assert successor.host is not None
    successor.host.check_invariants()
