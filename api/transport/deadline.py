"""`Deadline`: when one request must end — its --request-timeout after arrival, or at once when a
graceful shutdown stops waiting — and `Deadline.run`, which ends a wait for the request's next
output there with the APIError that tells the client why (api/pipeline.py's EngineStream then
closes the engine stream, which aborts it and frees its KV pages)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from api.errors import APIError

T = TypeVar("T")

REQUEST_TIMEOUT_CODE = "request_timeout"
SERVER_STOPPING_CODE = "server_stopping"


def request_timeout_error(timeout_s: float) -> APIError:
    # 504 in a body (or in-band once streaming): a retry would run just as long, so the SDK is
    # told not to (it honours x-should-retry).
    return APIError(
        504,
        f"the request ran longer than this server's limit of {timeout_s:g} s (--request-timeout) and was ended",
        code=REQUEST_TIMEOUT_CODE,
        headers={"x-should-retry": "false"},
    )


def server_stopping_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down and ended this request before it finished; retry it",
        code=SERVER_STOPPING_CODE,
        headers={"Retry-After": "2"},
    )


class Deadline:
    """Created on the event loop when the request arrives; read and changed only there."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.when = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s  # loop time
        self.error: APIError | None = None  # why the request ended early, once it has
        self._scope: asyncio.Timeout | None = None  # armed while the request awaits its next output

    @property
    def passed(self) -> bool:
        return self.when is not None and asyncio.get_running_loop().time() >= self.when

    def expire(self, error: APIError) -> None:
        """End the request now with `error` (a request already ended keeps its first reason)."""
        if self.error is None:
            self.error = error
        self.when = asyncio.get_running_loop().time()
        if self._scope is not None and not self._scope.expired():
            self._scope.reschedule(self.when)

    def reason(self) -> APIError:
        if self.error is None:
            assert self.timeout_s is not None, "a deadline without a timeout passed without expire()"
            self.error = request_timeout_error(self.timeout_s)
        return self.error

    def check(self) -> None:
        if self.passed:
            raise self.reason()

    async def run(self, work: Callable[[], Awaitable[T]]) -> T:
        """`await work()` until the deadline; then it is cancelled and the deadline's APIError
        raised. `expire` while it waits ends it at once."""
        self.check()
        try:
            async with asyncio.timeout_at(self.when) as scope:
                self._scope = scope
                return await work()
        except TimeoutError:
            if not scope.expired():
                raise
            raise self.reason() from None
        finally:
            self._scope = None
