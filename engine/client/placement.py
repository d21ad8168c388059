"""`Placement`: with --data-parallel-size N, which engine core a request goes to. In the server's
process, on the event loop; with one core none of this exists.

The rule. A request (all n samples of it, so that they share its prompt's pages on one core) goes
to the core holding the longest cached prefix of its prompt, among the cores whose load is at most
the least loaded one's + `slack`; ties go to the less loaded core, then the lower rank.
- Prefix: the prompt's full pages hashed as the scheduler hashes them (scheduler/block_manager.py
  `hash_block`, a chain from ROOT_HASH), matched page by page against each core's cache, up to the
  pages a hit can use (the last prompt token is always computed).
- What each core caches is the core's own record, not a guess: every step's outputs carry the
  hashes that entered and left its prefix cache (`PrefixCacheDelta`, engine/cache_events/prefix_cache_feed.py:
  the block manager's decisions, evictions and resets included), and this module keeps one set per
  core. A request's own pages count as cached on its core from the moment it is sent until its
  first output, when the core has reported them: a second user with the same system prompt
  arriving meanwhile joins the first.
- Load: the core's running + waiting requests (its last report) + the samples sent to it that it
  has not counted yet (engine/front/admission.py).
- Slack: max(MIN_SLACK, max_num_seqs // SLACK_DIVISOR) requests. A cached prefix saves its whole
  prefill, while a slightly fuller batch costs a step a little, so a cached prefix wins while the
  loads are close; but one hot prefix (a system prompt every user shares) must not pull every
  request onto one core: past the slack the least loaded core gets the request, and caches that
  prefix too, after which the loads decide between equals.
- A core that is restarting takes nothing while another runs.

Hybrid models (Qwen3.5/3.6) hit only where a DeltaNet state checkpoint ends (scheduler/
checkpoint_manager.py); pages are matched here, so a hit may be shorter than this rule counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.core_types import PrefixCacheDelta
from scheduler.block_manager import ROOT_HASH, hash_block

MIN_SLACK = 2
SLACK_DIVISOR = 16


def prompt_page_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of the prompt's full pages, as the scheduler computes it. NOTE: on the event
    loop, one blake2b per page (docs/PERF.md has its cost for an agent-sized prompt)."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, prompt_token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class Placement:
    def __init__(self, num_cores: int, block_size: int, max_num_seqs: int, prefix_caching: bool = True) -> None:
        """`prefix_caching` off: the cores cache nothing, and the least loaded core gets each request."""
        assert num_cores > 1, "placement is for several engine cores"
        self.num_cores = num_cores
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.slack = max(MIN_SLACK, max_num_seqs // SLACK_DIVISOR)
        self.cached: list[set[bytes]] = [set() for _ in range(num_cores)]  # each core's prefix cache
        self._sending: list[Counter[bytes]] = [Counter() for _ in range(num_cores)]  # pages of requests in transit
        self._in_transit: dict[str, tuple[int, list[bytes]]] = {}  # request id -> (core, its pages)

    def place(self, request_id: str, prompt_token_ids: Sequence[int], loads: Sequence[int | None]) -> int:
        """The core for this request (loads[c] None: core c is restarting); its pages count as
        cached there until `started`."""
        assert len(loads) == self.num_cores, "a load per core"
        up = [c for c in range(self.num_cores) if loads[c] is not None] or list(range(self.num_cores))
        load = {c: loads[c] or 0 for c in up}
        if not self.prefix_caching:
            return min(up, key=lambda c: (load[c], c))
        hashes = prompt_page_hashes(prompt_token_ids, self.block_size)
        usable = hashes[: (len(prompt_token_ids) - 1) // self.block_size]
        least = min(load.values())
        near = [c for c in up if load[c] <= least + self.slack]
        core = max(near, key=lambda c: (self.matched_pages(c, usable), -load[c], -c))
        self._sending[core].update(hashes)
        self._in_transit[request_id] = (core, hashes)
        return core

    def matched_pages(self, core: int, hashes: Sequence[bytes]) -> int:
        """How many of the chain's leading pages `core` holds (or is being sent)."""
        cached, sending = self.cached[core], self._sending[core]
        n = 0
        for h in hashes:
            if h not in cached and not sending[h]:
                break
            n += 1
        return n

    def started(self, request_id: str) -> None:
        """The request's first output (or its end): its pages are in its core's reports now."""
        entry = self._in_transit.pop(request_id, None)
        if entry is None:
            return
        core, hashes = entry
        sending = self._sending[core]
        for h in hashes:
            if sending[h] > 1:
                sending[h] -= 1
            else:
                del sending[h]

    def on_prefix_cache(self, core: int, delta: PrefixCacheDelta) -> None:
        cached = self.cached[core]
        if delta.cleared:
            cached.clear()
        cached.difference_update(delta.removed)
        cached.update(delta.stored)

    def on_core_lost(self, core: int) -> None:
        """Its successor starts with an empty cache, and the requests sent to it have ended."""
        self.cached[core].clear()
        self._sending[core].clear()
        for request_id in [r for r, (c, _) in self._in_transit.items() if c == core]:
            del self._in_transit[request_id]
