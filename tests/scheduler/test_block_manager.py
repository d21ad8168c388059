"""Block manager: exact page ids for allocation, freeing, prefix hits, LRU eviction and the
hash chain, plus a hypothesis-driven model check of ref counts and page contents."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager, hash_block
from scheduler.request import Request, SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=None))


def compute(bm: BlockManager, request: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
    """What one scheduled step does to a request: take pages, then its tokens are computed."""
    cached = cached or []
    if not bm.allocate(request, num_new_tokens, cached):
        return False
    request.num_computed_tokens += len(cached) * bm.block_size + num_new_tokens
    return True


def snapshot(bm: BlockManager) -> tuple[object, ...]:
    return (list(bm.ref_counts), list(bm.free_queue), dict(bm.cached), list(bm.block_hash))


# ---- exact page ids ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fresh_allocation_takes_pages_in_ascending_order(block_size: int) -> None:
    bm = BlockManager(num_blocks=12, block_size=block_size)
    a = make_request("a", list(range(1, 2 * block_size + 2)))  # 2 full pages + 1 token
    b = make_request("b", list(range(50, 50 + block_size)))  # exactly 1 page
    assert compute(bm, a, a.num_tokens)
    assert compute(bm, b, b.num_tokens)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert bm.ref_counts[:5] == [1, 1, 1, 1, 0]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (4, 8)
    bm.check_invariants()


def test_decode_takes_a_new_page_only_when_the_last_one_is_full() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3])
    assert compute(bm, r, 3)
    tables = []
    for token in range(10, 16):  # num_tokens 4..9
        r.output_token_ids.append(token)
        assert compute(bm, r, 1)
        tables.append(list(r.block_table))
    assert tables == [[0], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1, 2]]
    # Pages 0 and 1 are full and registered in the cache; page 2 holds 1 token and is not.
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None
    assert bm.block_hash[2] is None
    assert len(bm.cached) == 2


def test_freed_pages_join_the_free_queue_back_last_page_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert a.block_table == []
    assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0]
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_freed_prefix_pages_revive_before_fresh_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(1, 11)))  # pages [1..4] [5..8] [9 10]
    assert compute(bm, a, 10)
    bm.free(a)
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_request("b", list(range(1, 9)) + [77, 78, 79])  # same two full pages, new tail
    hit = bm.find_cached_prefix(b)
    assert hit == [0, 1]
    assert compute(bm, b, b.num_tokens - 8, hit)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 11
    # Page 2 (a's partial tail) was never cached and stays free, behind the fresh pages.
    assert list(bm.free_queue) == [4, 5, 6, 7, 2]
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    bm.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_prefix_hit_is_capped_below_the_last_token(block_size: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=block_size)
    tokens = list(range(1, 2 * block_size + 1))  # exactly two full pages
    a = make_request("a", tokens)
    assert compute(bm, a, a.num_tokens)
    bm.free(a)
    # The same prompt hits only its first page: the last token must be recomputed for logits.
    assert bm.find_cached_prefix(make_request("same", tokens)) == [0]
    # One more token and both pages hit.
    assert bm.find_cached_prefix(make_request("longer", tokens + [99])) == [0, 1]


def test_single_token_prompt_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=1)
    a = make_request("a", [5])
    assert compute(bm, a, 1)
    bm.free(a)
    assert bm.find_cached_prefix(make_request("b", [5])) == []
    assert bm.find_cached_prefix(make_request("c", [5, 6])) == [0]


def test_eviction_reuses_the_least_recently_freed_cached_page_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    b = make_request("b", [5, 6, 7, 8])
    assert compute(bm, a, 4) and compute(bm, b, 4)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [1, 0, 3, 2]
    evicted_hash = bm.block_hash[1]
    assert evicted_hash is not None
    c = make_request("c", [40, 41])
    assert compute(bm, c, 2)
    assert c.block_table == [1]  # a's tail page: freed first, so evicted first
    assert evicted_hash not in bm.cached
    assert bm.cached[bm.block_hash[1]] == 1  # now cached under c's content
    # a's head survives, its tail is gone; b's pages are untouched.
    assert bm.find_cached_prefix(make_request("a2", [1, 2, 3, 4, 9])) == [0]
    assert bm.find_cached_prefix(make_request("b2", [5, 6, 7, 8, 9])) == [2, 3]
    bm.check_invariants()


def test_a_hit_moves_revived_pages_out_of_the_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    assert compute(bm, a, 3)
    bm.free(a)  # free queue [2, 3, 1, 0]
    b = make_request("b", [1, 2, 9])
    hit = bm.find_cached_prefix(b)
    assert hit == [0]
    assert compute(bm, b, 1, hit)
    assert b.block_table == [0, 2]
    bm.free(b)
    # b freed its pages last, so they are now the most recently used: evicted last.
    assert list(bm.free_queue) == [3, 1, 2, 0]


def test_chained_hash_a_different_first_page_means_no_hit_on_matching_later_pages() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    bm.free(a)
    b = make_request("b", [9, 9, 3, 4, 5])  # page 1 tokens match a's page 1
    assert bm.find_cached_prefix(b) == []
    assert hash_block(hash_block(b"x", [1, 2]), [3, 4]) != hash_block(hash_block(b"x", [9, 9]), [3, 4])


def test_shared_prefix_pages_are_ref_counted_until_the_last_holder_frees() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    b = make_request("b", [1, 2, 3, 4, 6])  # a fork: same full pages, different last token
    hit = bm.find_cached_prefix(b)
    assert hit == [0, 1]
    assert compute(bm, b, 1, hit)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_used_blocks == 4
    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert list(bm.free_queue) == [4, 5, 6, 7, 2]
    bm.free(b)
    assert list(bm.free_queue) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_allocate_returns_false_and_changes_nothing_when_pages_run_short() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(1, 13)))
    assert compute(bm, a, 12)
    before = snapshot(bm)
    b = make_request("b", list(range(20, 28)))
    assert not bm.allocate(b, 8)
    assert b.block_table == []
    assert snapshot(bm) == before
    # A decode step that needs a fifth page fails the same way.
    a.output_token_ids.extend([13, 14, 15, 16, 17])
    assert compute(bm, a, 4)
    before = snapshot(bm)
    assert not bm.allocate(a, 1)
    assert a.block_table == [0, 1, 2, 3]
    assert snapshot(bm) == before


def test_allocate_with_a_hit_counts_revived_pages_against_the_free_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    assert compute(bm, a, 4)
    bm.free(a)  # free queue [2, 3, 1, 0], pages 0 and 1 cached
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # needs 5 pages: 2 revived + 3 fresh
    hit = bm.find_cached_prefix(b)
    assert hit == [0, 1]
    before = snapshot(bm)
    assert not bm.allocate(b, 5, hit)
    assert b.block_table == []
    assert snapshot(bm) == before
    assert bm.allocate(b, 4, hit)  # 2 revived + 2 fresh fits exactly
    assert b.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0


def test_freeing_a_page_twice_is_caught() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    assert compute(bm, a, 3)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table.extend(stale)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)


def test_disabled_prefix_caching_never_hits_nor_registers() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    assert bm.cached == {}
    bm.free(a)
    assert bm.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []


def test_reset_prefix_cache_forgets_every_hash_but_keeps_ownership() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    bm.reset_prefix_cache()
    assert bm.cached == {} and bm.block_hash == [None] * 4
    assert bm.ref_counts == [1, 1, 1, 0]
    bm.free(a)
    assert bm.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []
    bm.check_invariants()


# ---- model check: random operation sequences ---------------------------------------------------
# A few prompt families that share heads, so prefix hits (and partial hits) happen often.
_BASE = list(range(100, 124))
PREFIXES = [_BASE, _BASE[:6] + list(range(200, 218)), [7] * 24, [7] * 4 + list(range(300, 320))]


@dataclass
class Model:
    """The block manager plus what the test knows independently: each page's written tokens."""

    bm: BlockManager
    live: list[Request] = field(default_factory=list)  # hold pages
    preempted: list[Request] = field(default_factory=list)  # hold none, will resume
    kv: dict[int, list[int | None]] = field(default_factory=dict)  # page -> token in each slot
    hash_tokens: dict[bytes, tuple[int, ...]] = field(default_factory=dict)  # hash -> page tokens
    next_id: int = 0

    def write(self, request: Request, start: int, end: int) -> None:
        bs = self.bm.block_size
        for pos in range(start, end):
            page = request.block_table[pos // bs]
            self.kv.setdefault(page, [None] * bs)[pos % bs] = request.token_id(pos)

    def page_tokens(self, request: Request, i: int) -> list[int]:
        bs = self.bm.block_size
        return request.token_slice(i * bs, (i + 1) * bs)

    def schedule_first(self, request: Request, chunk: int) -> None:
        """First schedule (or resumption): prefix hit, then a chunk; dropped if pages run short."""
        bm = self.bm
        hit = bm.find_cached_prefix(request)
        for i, page in enumerate(hit):  # a hit must serve exactly this request's tokens
            assert self.kv[page] == self.page_tokens(request, i), f"page {page} hit with other content"
        num_cached = len(hit) * bm.block_size
        n = min(request.num_tokens - num_cached, chunk)
        before = snapshot(bm)
        if not bm.allocate(request, n, hit):
            assert snapshot(bm) == before and request.block_table == []
            return
        request.num_computed_tokens = num_cached
        self.write(request, num_cached, num_cached + n)
        request.num_computed_tokens += n
        self.live.append(request)

    def step(self, request: Request, chunk: int, token: int) -> None:
        """A prefill chunk, or a decode that appends a sampled token; preempted if pages run short."""
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)
        n = min(request.num_tokens - request.num_computed_tokens, chunk)
        before = snapshot(self.bm)
        if self.bm.allocate(request, n):
            self.write(request, request.num_computed_tokens, request.num_computed_tokens + n)
            request.num_computed_tokens += n
            return
        assert snapshot(self.bm) == before
        self.live.remove(request)
        self.bm.free(request)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants()
        holders: Counter[int] = Counter()
        for r in self.live:
            assert len(set(r.block_table)) == len(r.block_table), f"{r.request_id} holds a page twice"
            assert len(r.block_table) == bm.num_blocks_for(r.num_computed_tokens)
            holders.update(r.block_table)
            for pos in range(r.num_computed_tokens):  # nobody overwrote this request's KV
                assert self.kv[r.block_table[pos // bm.block_size]][pos % bm.block_size] == r.token_id(pos)
            for i, h in enumerate(r.block_hashes):
                self.hash_tokens[h] = tuple(self.page_tokens(r, i))
        for r in self.preempted:
            assert r.block_table == []
        assert [bm.ref_counts[b] for b in range(bm.num_blocks)] == [holders[b] for b in range(bm.num_blocks)]
        assert bm.num_used_blocks == len(holders)
        for page, n in holders.items():
            if n > 1:  # shared only through the same cached hash at the same position
                h = bm.block_hash[page]
                assert h is not None, f"page {page} shared by {n} requests without a cached hash"
                for r in self.live:
                    if page in r.block_table:
                        assert r.block_hashes[r.block_table.index(page)] == h
        for h, page in bm.cached.items():
            assert bm.block_hash[page] == h
            if h in self.hash_tokens:  # a cached page still holds the content it is cached under
                assert tuple(self.kv[page]) == self.hash_tokens[h]
        for page, h in enumerate(bm.block_hash):
            assert h is None or bm.cached[h] == page


op_strategy = st.one_of(  # three kinds of step: decodes outnumber arrivals, so pools fill up
    st.tuples(
        st.just("admit"),
        st.integers(0, len(PREFIXES) - 1),
        st.integers(1, 24),
        st.integers(0, 3),
        st.integers(1, 3),
        st.integers(1, 12),
    ),
    *(st.tuples(st.just("step"), st.integers(0, 63), st.integers(1, chunk), st.integers(0, 3)) for chunk in (1, 4, 12)),
    st.tuples(st.just("resume"), st.integers(0, 63), st.integers(1, 12)),
    st.tuples(st.just("free"), st.integers(0, 63)),
    st.tuples(st.just("abort_preempted"), st.integers(0, 63)),
)


@settings(
    max_examples=120, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(op_strategy, min_size=20, max_size=60),
)
def test_random_operations_keep_ref_counts_and_page_contents_consistent(
    num_blocks: int, block_size: int, ops: list[tuple[object, ...]]
) -> None:
    model = Model(BlockManager(num_blocks, block_size))
    for op in ops:
        kind = op[0]
        if kind == "admit":
            _, family, length, tail, n_fork, chunk = op
            prompt = PREFIXES[family][:length] + ([400 + tail] if tail else [])
            for _ in range(n_fork):  # n samples of one prompt: several requests, same tokens
                model.next_id += 1
                model.schedule_first(make_request(f"r{model.next_id}", prompt), chunk)
        elif kind == "step" and model.live:
            _, i, chunk, token = op
            model.step(model.live[i % len(model.live)], chunk, 500 + token)
        elif kind == "resume" and model.preempted:
            _, i, chunk = op
            model.schedule_first(model.preempted.pop(i % len(model.preempted)), chunk)
        elif kind == "free" and model.live:
            r = model.live.pop(op[1] % len(model.live))
            model.bm.free(r)
        elif kind == "abort_preempted" and model.preempted:
            model.bm.free(model.preempted.pop(op[1] % len(model.preempted)))  # holds nothing: no-op
        model.check()
    for r in model.live:
        model.bm.free(r)
    model.live.clear()
    model.check()
    assert model.bm.num_used_blocks == 0
    assert sorted(model.bm.free_queue) == list(range(num_blocks))
    assert model.bm.ref_counts == [0] * num_blocks


class _CountingTable(list):  # type: ignore[type-arg]
    """A block table that counts how many of its entries are read."""

    reads = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        _CountingTable.reads += 1
        return super().__getitem__(index)


def test_a_decode_step_looks_only_at_new_pages_not_the_whole_context() -> None:
    bm = BlockManager(num_blocks=80, block_size=4)
    request = make_request("long", list(range(256)))  # 64 full pages
    assert compute(bm, request, 256)
    request.block_table = _CountingTable(request.block_table)
    _CountingTable.reads = 0
    for token in range(8):  # two more full pages, one token per step
        request.output_token_ids.append(1000 + token)
        assert compute(bm, request, 1)
    assert _CountingTable.reads <= 2 * 2, f"{_CountingTable.reads} page reads for 2 new pages"
    assert len(bm.cached) == 66
