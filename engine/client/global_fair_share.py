"""`GlobalFairShare`: with --data-parallel-size N, fair share across API keys over all the engine
cores, as if they were one. In the server's process, on the event loop; with one core none of
this exists.

Each core's scheduler keeps its own virtual-token counters (scheduler/fair_queue.py) and reports,
with every step's stats, what it charged each key (`SchedulerStats.fair_charged`: tokens / weight).
Here those reports are summed, and each core is sent, per key, what the *other* cores charged
(`FairShareUpdate`); the core then orders its waiting requests by its own V plus that. A light
key whose requests all sit on core 0 (its conversation's prefix is cached there) while a heavy key
floods both cores is therefore served on core 0 ahead of the heavy key, as far as the heavy key's
service on core 1 puts it behind: the keys' service summed over the cores splits as it would on
one core.

When a core is sent an update: when its admission order matters, i.e. it has requests waiting
(at each report of another core that changed a count), and just before new requests go to it (so
an arriving key's starting V is set against fresh counts). The counts are at most one report of
each other core old. A restarted core carries on from its last report's counts, and its
supervisor hands it the others' (engine/client/supervisor.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.fair_queue import FairShareState


class GlobalFairShare:
    def __init__(self, num_cores: int) -> None:
        assert num_cores > 1, "global fair share is for several engine cores"
        self.num_cores = num_cores
        self._reports: list[FairShareState] = [() for _ in range(num_cores)]  # each core's last report
        self._charged: list[dict[str, float]] = [{} for _ in range(num_cores)]  # the same, by key
        self._sent: list[dict[str, float]] = [{} for _ in range(num_cores)]  # what each core was told

    def on_report(
        self, core: int, charged: FairShareState, queueing: Sequence[bool]
    ) -> list[tuple[int, FairShareState]]:
        """Core `core`'s counts, with its stats; the updates to send now: to each other core whose
        order they change (queueing[c]: core c has requests waiting, and is not restarting)."""
        if charged == self._reports[core]:
            return []
        self._reports[core] = charged
        self._charged[core] = dict(charged)
        return [
            (c, update) for c in range(self.num_cores) if c != core and queueing[c] and (update := self.update_for(c))
        ]

    def external(self, core: int, key: str) -> float:
        """What the cores other than `core` charged `key`, by their last reports."""
        return sum(charged.get(key, 0.0) for c, charged in enumerate(self._charged) if c != core)

    def update_for(self, core: int, keys: Iterable[str] | None = None) -> FairShareState:
        """What `core` has not been told yet of the other cores' charges (of `keys`, or of every key
        any core charged): the entries to send it, empty when it is up to date."""
        if keys is None:
            keys = sorted({key for charged in self._charged for key in charged})
        sent = self._sent[core]
        changed = []
        for key in keys:
            value = self.external(core, key)
            if sent.get(key, 0.0) != value:
                sent[key] = value
                changed.append((key, value))
        return tuple(changed)
