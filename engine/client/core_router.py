"""`CoreRouter`: with --data-parallel-size N, what AsyncEngine (engine/front/async_engine.py) asks about
its N engine cores, in the server's process on the event loop: which core takes a request
(engine/client/placement.py), what each core must be told of the others' fair-share counts
(engine/client/global_fair_share.py), and which cores are restarting. It owns no request state; with one
core AsyncEngine has none and sends everything to core 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.client.global_fair_share import GlobalFairShare
from engine.client.placement import Placement
from engine.core_types import EngineCoreOutputs, EngineCoreRequest
from scheduler.output import SchedulerStats

if TYPE_CHECKING:
    from engine.client.core_client import CoreClient


class CoreRouter:
    def __init__(self, clients: Sequence[CoreClient], max_num_seqs: int) -> None:
        info = clients[0].info
        self.clients = clients
        self.placement = Placement(len(clients), info.block_size, max_num_seqs, info.prefix_caching)
        self.fair_share = GlobalFairShare(len(clients))
        self.restarting: set[int] = set()  # lost cores whose successor has not reported yet

    def place(self, request_id: str, children: list[EngineCoreRequest], loads: list[int]) -> int:
        """The core for a request's samples (`loads`: each core's, engine/front/admission.py). The core is
        first told the other cores' fair-share counts: an arriving key starts at the V of the keys
        active there, which those counts are part of."""
        available = [None if core in self.restarting else load for core, load in enumerate(loads)]
        core = self.placement.place(request_id, children[0].prompt_token_ids, available)
        if update := self.fair_share.update_for(core):
            self.clients[core].update_fair_share(update)
        return core

    def started(self, request_id: str) -> None:
        """The request's first output, or its end: its core reports its pages itself now."""
        self.placement.started(request_id)

    def on_report(self, index: int, step: EngineCoreOutputs, stats: Sequence[SchedulerStats]) -> None:
        """A message of core `index`; `stats`: every core's last report, this one's included."""
        if step.prefix_cache is not None:
            self.placement.on_prefix_cache(index, step.prefix_cache)
        if step.stats is None:
            return
        self.restarting.discard(index)  # a lost core's successor reports as soon as it runs
        queueing = [bool(s.num_waiting) and core not in self.restarting for core, s in enumerate(stats)]
        for core, update in self.fair_share.on_report(index, step.stats.fair_charged, queueing):
            self.clients[core].update_fair_share(update)

    def on_core_lost(self, index: int) -> None:
        self.placement.on_core_lost(index)
        self.restarting.add(index)
