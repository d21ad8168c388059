"""`RequestLogMiddleware`: one log line for every refused request (4xx and 5xx: method, path,
status, the key's name, the error's code and parameter, the client's address, its message),
counted in `fp4serve_http_requests_rejected_total{reason}`; and, with --access-log, one line for
every request. An operator whose agent "just fails" finds here what the client was told.

It sits inside InFlightMiddleware and outside FramingMiddleware and KeyMiddleware, so it sees the
framing's 400 and 413, the key middleware's own 401 and 429, and the key's name that one leaves in
scope["state"]. The error's fields come from what the exception handlers (api/errors.py) left in
scope["state"] (OpenAI's code and param, even on /v1/messages, whose body has only Anthropic's
type), else from the JSON body itself."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.access.keys import KEY_STATE
from api.errors import CLIENT_CLOSED, ERROR_STATE, OVERLOADED_TYPE, ErrorBody
from api.transport.metrics import ServerMetrics

logger = logging.getLogger("fp4serve.requests")
access_logger = logging.getLogger("fp4serve.access")

MAX_ERROR_BODY = 16 << 10  # bytes of an error body kept to read its fields
MAX_LOGGED_MESSAGE = 500  # characters of an error message in the log line


class RequestLogMiddleware:
    """Pure ASGI; reads nothing of a successful response's body."""

    def __init__(
        self, app: ASGIApp, metrics: ServerMetrics, access_log: bool = False, skipped_paths: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log
        self.skipped_paths = frozenset(skipped_paths)  # neither logged nor counted (probes, scrapes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skipped_paths:
            await self.app(scope, receive, send)
            return
        began = time.monotonic()
        status: int | None = None
        body = bytearray()
        logged = False

        async def send_and_watch(message: Message) -> None:
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None:
                if status >= 400:
                    body.extend(message.get("body", b"")[: MAX_ERROR_BODY - len(body)])
                if not message.get("more_body", False):
                    # NOTE: logged before the last byte leaves, so that a client holding the answer
                    # finds its line already written (a test, an operator tailing the log).
                    logged = True
                    self._log(scope, status, bytes(body), time.monotonic() - began)
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            # Answered outside, by Starlette's outermost handler (api/errors.py handle_unexpected),
            # which logs the traceback.
            status = status or 500
            scope.setdefault("state", {})[ERROR_STATE] = ErrorBody(
                "internal server error", "server_error", code="internal_error"
            )
            raise
        finally:
            if not logged:
                self._log(scope, status or 500, bytes(body), time.monotonic() - began)

    def _log(self, scope: Scope, status: int, body: bytes, seconds: float) -> None:
        state = scope.get("state") or {}
        record = state.get(KEY_STATE)
        key = record.name if record is not None else "-"
        method, path = scope["method"], scope["path"]
        client = scope.get("client")
        address = client[0] if client else "-"
        if self.access_log:
            access_logger.info("%s %s %s %d key=%s %.3fs", address, method, path, status, key, seconds)
        if status < 400 or status == CLIENT_CLOSED:
            return
        error = state.get(ERROR_STATE) or _from_body(status, body)
        message = (
            error.message if len(error.message) <= MAX_LOGGED_MESSAGE else error.message[:MAX_LOGGED_MESSAGE] + "..."
        )
        (logger.warning if status >= 500 else logger.info)(
            "refused %s %s: %d key=%s code=%s param=%s client=%s: %s",
            method,
            path,
            status,
            key,
            error.code or error.type,
            error.param or "-",
            address,
            message,
        )
        if status != 429:  # NOTE: api/access/rate_limit.py counts its own refusals, as reason rate_limited
            self.metrics.rejected.labels(reason=rejection_reason(error)).inc()


def rejection_reason(error: ErrorBody) -> str:
    """The `reason` label: the error's code (context_length_exceeded, invalid_api_key, ...), else
    its type; a full queue is `overloaded`."""
    if error.type == OVERLOADED_TYPE:
        return "overloaded"
    return error.code or error.type


def _from_body(status: int, body: bytes) -> ErrorBody:
    """The error fields of an OpenAI-shaped (`error.code`, `error.param`) or Anthropic-shaped
    (`error.type` only) body."""
    try:
        parsed: Any = orjson.loads(body)
        error = parsed["error"]
        return ErrorBody(
            str(error.get("message", "")), str(error.get("type") or "error"), error.get("param"), error.get("code")
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return ErrorBody(f"HTTP {status}", "error")
