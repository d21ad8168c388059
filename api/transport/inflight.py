"""`InFlight`: the requests on /v1/* being served, each with its `Deadline`, from arrival until its
response is sent; a graceful shutdown waits on it, then ends what is left. `InFlightMiddleware`
registers every request and hands the route its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import APIError
from api.transport.client_watch import watched
from api.transport.deadline import Deadline
from api.transport.metrics import ServerMetrics

DEADLINE_KEY = "fp4serve.deadline"  # in the request's scope["state"]
TRACKED_PREFIX = "/v1/"


class InFlight:
    """Touched on the event loop only."""

    def __init__(self, request_timeout_s: float | None, metrics: ServerMetrics) -> None:
        self.request_timeout_s = request_timeout_s
        self._metrics = metrics
        self._live: set[Deadline] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return len(self._live)

    @contextmanager
    def track(self) -> Iterator[Deadline]:
        deadline = Deadline(self.request_timeout_s)
        self._live.add(deadline)
        self._idle.clear()
        self._metrics.in_flight.set(len(self._live))
        try:
            yield deadline
        finally:
            self._live.discard(deadline)
            self._metrics.in_flight.set(len(self._live))
            if deadline.error is not None and deadline.error.code is not None:
                self._metrics.ended_early.labels(reason=deadline.error.code).inc()
            if not self._live:
                self._idle.set()

    def expire_all(self, error: APIError) -> int:
        """End every live request now with `error`; returns how many there were."""
        live = list(self._live)
        for deadline in live:
            deadline.expire(error)
        return len(live)

    async def wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """True once nothing is in flight; False after `timeout_s`, or as soon as `hurry` is set."""
        waits = [asyncio.ensure_future(self._until_idle())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
                with suppress(asyncio.CancelledError):
                    await wait
        return not self._live

    async def _until_idle(self) -> None:
        # NOTE: a request may start between the wake-up and the check (during a drain, a 503 that
        # ends at once); wait again rather than report idle while one is live.
        while self._live:
            await self._idle.wait()


class InFlightMiddleware:
    """Pure ASGI (no body buffering), outermost, so a request counts until its last byte is sent,
    and no longer: every HTTP request runs under a ClientWatch (api/transport/client_watch.py), so one whose
    client left ends, and its count and key slot (api/access/keys.py) are released, on any protocol."""

    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app = app
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not scope["path"].startswith(TRACKED_PREFIX):
            await watched(self.app, scope, receive, send)
            return
        with self.in_flight.track() as deadline:
            state: dict[str, Any] = {**scope.get("state", {}), DEADLINE_KEY: deadline}
            await watched(self.app, {**scope, "state": state}, receive, send)


def request_deadline(scope: Scope) -> Deadline | None:
    return scope.get("state", {}).get(DEADLINE_KEY)
