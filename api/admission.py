"""`Admission`: the bounded queue in front of the engine. A request is refused at once, with a
503 `overloaded_error` and Retry-After, when --max-queued-requests or --max-queued-tokens is
reached; admitted requests are never disturbed. Queued means admitted but not running, beyond
the free batch slots the next step fills (a burst at an idle server is not a queue).

Two checks, because tokenizing happens between them: an early one before the prompt is
tokenized (counting requests already being tokenized, so a flood cannot pile up there), and the
exact one where the engine adds the request to its queue (engine/async_engine.py `_admit`,
answered by api/errors.py `handle_engine_overloaded`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from api.errors import overloaded
from api.metrics import ServerMetrics
from engine.async_engine import QueueLimits

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


class Admission:
    """Touched on the event loop only."""

    def __init__(self, limits: QueueLimits, metrics: ServerMetrics) -> None:
        self.limits = limits
        self._metrics = metrics
        self.num_preparing = 0  # requests past the early check, not yet handed to the engine

    @contextmanager
    def preparing(self, engine: AsyncEngine) -> Iterator[None]:
        """Around tokenization: refuses (APIError 503) if the queue is full, else counts the
        request as queued until the block ends."""
        self.check(engine)
        self.num_preparing += 1
        try:
            yield
        finally:
            self.num_preparing -= 1

    def check(self, engine: AsyncEngine) -> None:
        max_requests, max_tokens = self.limits.max_queued_requests, self.limits.max_queued_tokens
        if max_requests is not None:
            # This request and those being tokenized, as if they had arrived: more than the bound
            # would wait beyond the free batch slots.
            if engine.num_queued_requests(arriving=self.num_preparing + 1) > max_requests:
                queued = engine.num_queued_requests(arriving=self.num_preparing)
                self._metrics.rejected.labels(reason="overloaded").inc()
                raise overloaded(f"{queued} requests are already waiting for a batch slot (limit {max_requests})")
        if max_tokens is not None:
            queued = engine.num_queued_tokens()
            if queued >= max_tokens:
                self._metrics.rejected.labels(reason="overloaded").inc()
                raise overloaded(f"{queued} prompt tokens are already waiting for a batch slot (limit {max_tokens})")
