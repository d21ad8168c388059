"""Recurrent-state slots of hybrid models, owned like KV pages: a running sequence holds exactly one
slot; finishing, aborting or preemption gives it back. The lowest free id goes out first, so slot
ids are predictable in tests. Pure bookkeeping: the tensors live in engine/attention/state_pool.py."""

from __future__ import annotations

import heapq

from scheduler.request import Request


class SlotManager:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, "need at least one state slot"
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a min-heap of free slot ids

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, request: Request) -> bool:
        """Give `request` a slot unless it holds one; False when none is free."""
        if request.state_slot is not None:
            return True
        if not self._free:
            return False
        request.state_slot = heapq.heappop(self._free)
        return True

    def free(self, request: Request) -> None:
        """Return the request's slot, if it holds one."""
        if request.state_slot is None:
            return
        assert request.state_slot not in self._free, f"slot {request.state_slot} freed twice"
        heapq.heappush(self._free, request.state_slot)
        request.state_slot = None
