"""Data parallel, the front's placement (engine/client/placement.py) and the cores' prefix-cache feed
(engine/cache_events/prefix_cache_feed.py), pure Python: the front's page hashes are the scheduler's own; the
copy of each core's cache that the feed keeps equals the block manager's, through evictions and
resets; the rule (best cached prefix among the cores within the load slack, then least load, then
the lower rank; a request's pages count on its core while it is in transit; a restarting core
takes nothing while another runs)."""

from __future__ import annotations

import random

import pytest

from engine.cache_events.prefix_cache_feed import PrefixCacheFeed
from engine.client.placement import MIN_SLACK, Placement, prompt_page_hashes
from engine.core_types import PrefixCacheDelta
from scheduler.block_manager import BlockManager
from tests.factories import make_request

BS = 4


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_the_front_hashes_a_prompt_as_the_block_manager_does() -> None:
    prompt = tokens(0, 4 * BS + 3)
    request = make_request("r", prompt)
    BlockManager(64, BS).extend_hashes(request, len(prompt))
    assert prompt_page_hashes(prompt, BS) == request.block_hashes and len(request.block_hashes) == 4
    assert prompt_page_hashes(prompt[: BS - 1], BS) == []


def test_the_fed_copy_follows_the_cache_through_evictions_and_a_reset() -> None:
    """A small pool under random traffic sharing prefixes: after every 'step' the front's set for the
    core is exactly the block manager's cached hashes."""
    bm = BlockManager(12, BS)
    feed = PrefixCacheFeed()
    bm.event_sink = feed
    placement = Placement(2, BS, max_num_seqs=8)
    rng = random.Random(1)
    systems = [tokens(100 + i, 3 * BS) for i in range(3)]
    live = []
    evicted = False
    for step in range(200):
        if live and (rng.random() < 0.5 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            request = make_request(f"r{step}", rng.choice(systems) + tokens(step, rng.randrange(1, 2 * BS)))
            hit = bm.find_cached_prefix(request)
            if bm.allocate(request, request.num_tokens - len(hit) * BS, hit):
                request.num_computed_tokens = request.num_tokens
                live.append(request)
        if step == 150:
            bm.reset_prefix_cache()
        if (delta := feed.take()) is not None:
            evicted |= bool(delta.removed)
            placement.on_prefix_cache(1, delta)
        assert placement.cached[1] == set(bm.cached), step
        assert placement.cached[0] == set()
    assert evicted, "the pool should have evicted cached pages"


def test_a_hash_evicted_and_stored_again_in_one_step_is_sent_as_it_ends() -> None:
    feed = PrefixCacheFeed()
    request = make_request("r", tokens(2, 2 * BS))
    request.block_hashes.extend(prompt_page_hashes(request.prompt_token_ids, BS))
    feed.blocks_stored(request, [0])
    assert feed.take() == PrefixCacheDelta(stored=(request.block_hashes[0],))
    feed.block_removed(request.block_hashes[0])
    feed.blocks_stored(request, [0, 1])
    feed.block_removed(request.block_hashes[1])
    assert feed.take() == PrefixCacheDelta(stored=(request.block_hashes[0],), removed=(request.block_hashes[1],))
    assert feed.take() is None
    feed.blocks_stored(request, [1])
    feed.all_cleared()
    assert feed.take() == PrefixCacheDelta(cleared=True)


def cache(placement: Placement, core: int, prompt: list[int]) -> None:
    placement.on_prefix_cache(core, PrefixCacheDelta(stored=tuple(prompt_page_hashes(prompt, BS))))


def test_the_core_with_the_longest_cached_prefix_wins_while_the_loads_are_close() -> None:
    placement = Placement(3, BS, max_num_seqs=8)
    assert placement.slack == MIN_SLACK
    system = tokens(3, 4 * BS)
    cache(placement, 1, system[: 2 * BS])
    cache(placement, 2, system)
    prompt = system + tokens(4, 5)
    assert placement.place("a", prompt, [0, 0, 2]) == 2  # 4 pages beat 2, within the slack
    assert placement.place("b", prompt, [0, 0, 3]) == 1  # core 2 is past it: core 1's 2 pages
    assert placement.place("c", tokens(5, 9), [1, 0, 0]) == 1  # nothing cached anywhere: least load, lower rank


def test_a_hit_leaves_the_last_prompt_token_to_compute() -> None:
    placement = Placement(2, BS, max_num_seqs=8)
    prompt = tokens(6, 2 * BS)
    cache(placement, 1, prompt)
    # The second page would need the prompt's last token: only the first counts, on either core.
    cache(placement, 0, prompt[:BS])
    assert placement.place("a", prompt, [0, 0]) == 0


def test_pages_in_transit_count_on_their_core_until_the_first_output() -> None:
    placement = Placement(2, BS, max_num_seqs=8)
    system = tokens(7, 3 * BS)
    assert placement.place("first", system + [1, 2], [0, 0]) == 0
    # Core 0 reported nothing yet; the second user with the same system prompt joins the first.
    assert placement.place("second", system + [3, 4], [1, 0]) == 0
    placement.started("first")
    placement.started("second")
    assert placement.place("third", system + [5, 6], [2, 0]) == 1  # nothing reported: nothing left on 0
    placement.started("third")
    cache(placement, 0, system)
    assert placement.place("fourth", system + [7, 8], [2, 1]) == 0


def test_a_hot_prefix_spills_to_the_least_loaded_core_past_the_slack() -> None:
    placement = Placement(2, BS, max_num_seqs=64)
    assert placement.slack == 4
    system = tokens(8, 3 * BS)
    cache(placement, 0, system)
    assert placement.place("a", system + [1], [4, 0]) == 0
    assert placement.place("b", system + [2], [5, 0]) == 1


def test_a_restarting_core_takes_nothing_while_another_runs() -> None:
    placement = Placement(2, BS, max_num_seqs=8)
    prompt = tokens(9, 3 * BS)
    cache(placement, 0, prompt)
    assert placement.place("a", prompt, [None, 5]) == 1
    assert placement.place("b", prompt, [None, None]) == 0  # all restarting: it waits for core 0
    placement.on_core_lost(0)
    assert placement.cached[0] == set()
    assert placement.place("c", prompt, [0, 0]) == 1  # core 1 has "a"'s pages in transit


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_without_prefix_caching_only_the_load_counts(prefix_caching: bool) -> None:
    placement = Placement(2, BS, max_num_seqs=8, prefix_caching=prefix_caching)
    prompt = tokens(10, 3 * BS)
    placement.place("a", prompt, [0, 0])
    assert placement.place("b", prompt, [1, 0]) == (0 if prefix_caching else 1)
