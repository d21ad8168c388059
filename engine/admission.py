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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from scheduler.scheduler import SchedulerStats


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
                raise ValueError(f"{name} must be positive or None, got {value}")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at a `QueueLimits` bound; the request was not admitted."""


class Admission:
    def __init__(self, limits: QueueLimits, max_num_seqs: int) -> None:
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        self.num_preparing = 0  # requests past the early check, not yet added
        self._stats = SchedulerStats(0, 0, 0, 1, 0, 0, 0)  # the core's last report
        self._num_sent = 0  # samples sent to the core, ever
        self._in_transit: deque[int] = deque()  # prompt tokens of each sent sample the core has not counted, in order

    # ---- what the engine tells it ---------------------------------------------------------------
    def on_sent(self, num_samples: int, num_prompt_tokens: int) -> None:
        self._num_sent += num_samples
        self._in_transit.extend([num_prompt_tokens] * num_samples)

    def on_stats(self, stats: SchedulerStats) -> None:
        self._stats = stats
        uncounted = max(0, self._num_sent - stats.num_added)
        while len(self._in_transit) > uncounted:
            self._in_transit.popleft()

    def on_core_lost(self) -> None:
        """The engine process was lost (engine/supervisor.py): every sample sent to it has ended,
        and the new core counts what it is handed from zero."""
        self._stats = SchedulerStats(0, 0, 0, 1, 0, 0, 0)
        self._num_sent = 0
        self._in_transit.clear()

    # ---- the rule ------------------------------------------------------------------------------------
    def num_queued_requests(self, ahead: int = 0) -> int:
        """Samples that will still wait after the next step fills the free batch slots: the
        scheduler's waiting ones, those in transit to it, and `ahead` more (being tokenized)."""
        s = self._stats
        free = max(0, self.max_num_seqs - s.num_running)
        return max(0, s.num_waiting + len(self._in_transit) + ahead - free)

    def num_queued_tokens(self) -> int:
        """Tokens still to compute of the samples counted by num_queued_requests: the scheduler's,
        then those in transit past the slots its waiting ones leave free."""
        s = self._stats
        free_for_transit = max(0, self.max_num_seqs - s.num_running - s.num_waiting)
        return s.num_queued_tokens + sum(list(self._in_transit)[free_for_transit:])

    def admit(self, num_samples: int, num_prompt_tokens: int, ahead: int = 0) -> None:
        """Raises EngineOverloadedError when `num_samples` more samples of `num_prompt_tokens` each
        (with `ahead` others before them) would pass a bound. An empty queue takes any request, so
        none is refused merely for being large (api/ bounds n and the prompt length)."""
        queued = self.num_queued_requests(ahead)
        if queued == 0:
            return
        max_requests, max_tokens = self.limits.max_queued_requests, self.limits.max_queued_tokens
        if max_requests is not None and queued + num_samples > max_requests:
            raise EngineOverloadedError(f"{queued} requests are already waiting for a batch slot (limit {max_requests})")
        if max_tokens is not None:
            queued_tokens = self.num_queued_tokens()
            if queued_tokens + num_samples * num_prompt_tokens > max_tokens:
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
