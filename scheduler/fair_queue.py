"""The order in which waiting requests are admitted: `fcfs` (arrival order, the default before
issue 17), `priority` (key priority, then the request's vLLM `priority`, then arrival; lower
first) and `fair` (weighted fair share across API keys).

Fair share: each key has a virtual token counter V = tokens served / weight, charged for every
token a step schedules for it (prefill chunks and decodes, recomputes after a preemption too).
Admission takes the waiting key with the smallest V; within a key, the request's priority, then
arrival. A key that arrives or returns (it had nothing in the scheduler) starts at the smallest
V among the active keys, so an idle key cannot bank credit and then flood.

Bound (tests/scheduler/test_fair_queue.py checks it with hypothesis): while keys a and b both have requests
waiting, V_a - V_b <= (max_num_seqs + 1) * W / min(w_a, w_b), where W bounds the tokens one request
costs (prompt + max_tokens). Why: a key is admitted only while its V is the (tentative) minimum;
after that its V grows only by the work of requests it already has running (at most max_num_seqs
of them, each at most W), and one step's tentative charge for the other key is at most W. So in
any window [t1, t2] in which both keys have a backlog, their tokens served per weight differ by at
most twice that bound.

A starved key does NOT preempt the most-served key's running request by default: on recompute
the victim's KV work is thrown away (on CPU a long prompt costs seconds), and a slot frees as soon
as any running request ends, which fair admission then gives to the starved key; max_tokens bounds
that wait. The bound above holds without it.

Pure Python; the scheduler calls `on_add`, `on_remove`, `charge` and `order` (scheduler.py).
The counters outlive an engine process: the scheduler reports them with its stats (`snapshot`),
and an engine started in a crashed one's place begins from the last report (`restore`), so a
restart hands no key fresh credit.

Data parallel (several engine cores behind one server, engine/client/global_fair_share.py): V is global.
Each core also counts what it charged each key (`charged`: tokens / weight, without the lifts
above) and reports it; the front sums the other cores' counts into this core's `external`, and
every comparison here (admission order, the lift of an arriving key) is on V + external. So a key
served on another core is behind here too, and the bound above holds for the keys' service summed
over the cores. With one core `external` stays empty and nothing changes.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from scheduler.request import Request

Policy = Literal["fcfs", "priority", "fair"]
POLICIES: tuple[Policy, ...] = ("fair", "fcfs", "priority")
# (key name, V) per key, sorted by name: what crosses the process boundary with the stats.
FairShareState = tuple[tuple[str, float], ...]


class FairQueue:
    def __init__(self, policy: Policy = "fcfs") -> None:
        assert policy in POLICIES, f"unknown scheduling policy {policy!r}"
        self.policy = policy
        self.vtime: dict[str, float] = {}  # key name -> tokens served / weight
        self.served: dict[str, int] = defaultdict(int)  # key name -> tokens served (for tests, stats)
        self._active: dict[str, int] = defaultdict(int)  # key name -> requests in the scheduler
        # Data parallel: tokens / weight charged here, per key (V without the lifts), and what the
        # other cores charged each key, as the front last told it (empty with one core).
        self.charged: dict[str, float] = {}
        self.external: dict[str, float] = {}

    def on_add(self, request: Request) -> None:
        key = request.key
        if not self._active[key]:
            # Arriving or returning: start at the smallest V of the active keys (no banked credit).
            floor = min((self.global_vtime(k) for k, n in self._active.items() if n and k in self.vtime), default=None)
            own = self.vtime.get(key, 0.0)
            self.vtime[key] = own if floor is None else max(own, floor - self.external.get(key, 0.0))
        self._active[key] += 1

    def on_remove(self, request: Request) -> None:
        self._active[request.key] -= 1
        if not self._active[request.key]:
            del self._active[request.key]

    def charge(self, requests: Iterable[Request], num_new: Mapping[str, int]) -> None:
        """The step scheduled num_new[request_id] tokens for each request."""
        for r in requests:
            n = num_new[r.request_id]
            self.served[r.key] += n
            self.vtime[r.key] = self.vtime.get(r.key, 0.0) + n / r.weight
            self.charged[r.key] = self.charged.get(r.key, 0.0) + n / r.weight

    def global_vtime(self, key: str) -> float:
        """The key's V over every engine core: this one's, plus what the others charged it."""
        return self.vtime.get(key, 0.0) + self.external.get(key, 0.0)

    def set_external(self, updates: FairShareState) -> None:
        """What the other engine cores have charged these keys, in all (engine/client/global_fair_share.py)."""
        self.external.update(updates)

    def snapshot(self) -> FairShareState:
        return tuple(sorted(self.vtime.items()))

    def charged_snapshot(self) -> FairShareState:
        return tuple(sorted(self.charged.items()))

    def restore(self, state: FairShareState, charged: FairShareState = ()) -> None:
        """Start from a previous engine's counters; only before any request arrived."""
        assert not self._active, "fair-share counters are restored before the first request"
        self.vtime = dict(state)
        self.charged = dict(charged)

    def order(self, waiting: Sequence[Request]) -> list[Request] | None:
        """The waiting requests in admission order, or None to keep the queue as it is (fcfs)."""
        if self.policy == "fcfs" or len(waiting) < 2:
            return None
        if self.policy == "priority":
            return sorted(waiting, key=lambda r: (r.key_priority, r.priority, r.arrival_time))
        per_key: dict[str, list[Request]] = defaultdict(list)
        for r in waiting:
            per_key[r.key].append(r)
        heap = []
        for key, queue in per_key.items():
            queue.sort(key=lambda r: (r.priority, r.arrival_time))  # stable: ties keep queue order
            queue.reverse()  # pop() takes the first
            heap.append((self.global_vtime(key), queue[-1].arrival_time, key))
        heapq.heapify(heap)
        ordered: list[Request] = []
        while heap:
            v, _, key = heapq.heappop(heap)
            queue = per_key[key]
            r = queue.pop()
            ordered.append(r)
            if queue:
                # Tentatively charge what this request will cost to compute, so one step admits
                # across keys rather than a whole key's queue first.
                cost = max(r.num_tokens - r.num_computed_tokens, 1) / r.weight
                heapq.heappush(heap, (v + cost, queue[-1].arrival_time, key))
        return ordered
