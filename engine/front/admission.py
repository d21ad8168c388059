"""`Admission`: the bounded queue in front of the engine core, one rule in one place. A request is
refused at once (`EngineOverloadedError`, which api/ answers with a 503 `overloaded_error` and
Retry-After) when --max-queued-requests or --max-queued-tokens is reached; admitted requests are
never disturbed. Queued means admitted but not running, beyond the free batch slots the next step
fills, so a burst at an idle server is not a queue.

What is queued is the scheduler's own count (`SchedulerStats`: running, waiting, and the tokens of
the waiting requests past the free slots, reported with every step), plus the samples the front
has sent that the core has not counted yet (the core reports how many it was ever handed).

The same rule is checked twice, because tokenizing happens in between: early, before the prompt
is tokenized (`preparing`, which counts the requests being tokenized, so a flood cannot pile up
there), and where AsyncEngine adds the request (`admit`). Touched on the event loop only.

With data parallel (--data-parallel-size N) the rule is the same over the N engine cores: queued
is what no core can start at its next step. Each core's own count is kept as above (its reports,
the samples in transit to it); a core's waiting samples beyond its free slots are queued (they
cannot move to another core), and the requests being tokenized, not yet placed, are queued only
beyond the free slots left on all the cores together. Each core's load (running + waiting + in
transit, `loads`) is what engine/client/placement.py balances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.errors import ConfigError
from scheduler.output import SchedulerStats


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on what waits for a batch slot (admitted, not yet running, and beyond the slots the
    next step will fill); None: no bound."""

    max_queued_requests: int | None = None  # each of a request's n samples counts
    max_queued_tokens: int | None = None  # prompt tokens still to compute

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {value}")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at a `QueueLimits` bound; the request was not admitted."""


@dataclass
class _CoreCounts:
    """What the front knows of one engine core's queue."""

    stats: SchedulerStats = field(default_factory=lambda: SchedulerStats(0, 0, 0, 1, 0, 0, 0))  # its last report
    num_sent: int = 0  # samples sent to the core, ever (by this core process)
    # Prompt tokens of each sent sample the core has not counted, in order.
    in_transit: deque[int] = field(default_factory=deque)

    def pending(self) -> int:
        """Samples waiting at this core or on their way to it."""
        return self.stats.num_waiting + len(self.in_transit)


class Admission:
    def __init__(self, limits: QueueLimits, max_num_seqs: int, num_cores: int = 1) -> None:
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        self.num_preparing = 0  # requests past the early check, not yet added
        self._cores = [_CoreCounts() for _ in range(num_cores)]

    # ---- what the engine tells it ---------------------------------------------------------------
    def on_sent(self, num_samples: int, num_prompt_tokens: int, core: int = 0) -> None:
        counts = self._cores[core]
        counts.num_sent += num_samples
        counts.in_transit.extend([num_prompt_tokens] * num_samples)

    def on_stats(self, stats: SchedulerStats, core: int = 0) -> None:
        counts = self._cores[core]
        counts.stats = stats
        uncounted = max(0, counts.num_sent - stats.num_added)
        while len(counts.in_transit) > uncounted:
            counts.in_transit.popleft()

    def on_core_lost(self, core: int = 0) -> None:
        """The engine process was lost (engine/client/supervisor.py): every sample sent to it has ended,
        and the new core counts what it is handed from zero."""
        self._cores[core] = _CoreCounts()

    def loads(self) -> list[int]:
        """Each core's running and waiting samples, and those on their way to it."""
        return [counts.stats.num_running + counts.pending() for counts in self._cores]

    # ---- the rule ------------------------------------------------------------------------------------
    def _free(self, counts: _CoreCounts) -> int:
        return max(0, self.max_num_seqs - counts.stats.num_running)

    def num_queued_requests(self, ahead: int = 0) -> int:
        """Samples that will still wait after the next step of each core fills its free batch
        slots: the schedulers' waiting ones, those in transit to them, and `ahead` more (being
        tokenized, which may go to any core)."""
        queued = spare = 0
        for counts in self._cores:
            surplus = counts.pending() - self._free(counts)
            queued += max(0, surplus)
            spare += max(0, -surplus)
        return queued + max(0, ahead - spare)

    def num_queued_tokens(self) -> int:
        """Tokens still to compute of the samples counted by num_queued_requests: each scheduler's,
        then those in transit past the slots its waiting ones leave free."""
        total = 0
        for counts in self._cores:
            s = counts.stats
            free_for_transit = max(0, self.max_num_seqs - s.num_running - s.num_waiting)
            total += s.num_queued_tokens + sum(list(counts.in_transit)[free_for_transit:])
        return total

    def admit(self, num_samples: int, num_prompt_tokens: int, ahead: int = 0) -> None:
        """Raises EngineOverloadedError when `num_samples` more samples of `num_prompt_tokens` each
        (with `ahead` others before them) would pass a bound. An empty queue takes any request, so
        none is refused merely for being large (api/ bounds n and the prompt length); samples that
        a core can start at once (with data parallel, another core's free slots) are not queued."""
        queued = self.num_queued_requests(ahead)
        if queued == 0:
            return
        newly_queued = self.num_queued_requests(ahead + num_samples) - queued
        max_requests, max_tokens = self.limits.max_queued_requests, self.limits.max_queued_tokens
        if max_requests is not None and queued + newly_queued > max_requests:
            raise EngineOverloadedError(
                f"{queued} requests are already waiting for a batch slot (limit {max_requests})"
            )
        if max_tokens is not None:
            queued_tokens = self.num_queued_tokens()
            if queued_tokens + newly_queued * num_prompt_tokens > max_tokens:
                raise EngineOverloadedError(
                    f"{queued_tokens} prompt tokens are already waiting for a batch slot (limit {max_tokens})"
                )

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Around tokenization: the early check (one sample of at least one token, behind the
        requests already being tokenized), then the request counts as queued until the block ends."""
        self.admit(1, 1, ahead=self.num_preparing)
        self.num_preparing += 1
        try:
            yield
        finally:
            self.num_preparing -= 1
