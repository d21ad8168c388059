"""`RequestLogMiddleware`: one log line for every refused request (4xx and 5xx: method, path,
status, the key's name, the error's code and parameter, its message), counted in
`fp4serve_http_requests_rejected_total{reason}`; and, with --access-log, one line for every request.
An operator whose agent "just fails" finds here what the client was told.

It sits inside InFlightMiddleware and outside KeyMiddleware, so it sees the key middleware's own
401 and 429 and the key's name it leaves in scope["state"]. The error's fields come from what the
exception handlers (api/errors.py) left in scope["state"] (OpenAI's code and param, even on
/v1/messages, whose body has only Anthropic's type), else from the JSON body itself."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import CLIENT_CLOSED, ERROR_STATE, OVERLOADED_TYPE, ErrorBody
from api.keys import KEY_STATE
from api.metrics import ServerMetrics

logger = logging.getLogger("fp4serve.requests")
access_logger = logging.getLogger("fp4serve.access")

MAX_ERROR_BODY = 16 << 10  # bytes of an error body kept to read its fields
MAX_LOGGED_MESSAGE = 500  # characters of an error message in the log line


class RequestLogMiddleware:
    """Pure ASGI; reads nothing of a successful response's body."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, access_log: bool = False,
                 skipped_paths: tuple[str, ...] = ()) -> None:
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

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                body.extend(message.get("body", b"")[:MAX_ERROR_BODY - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            # Answered outside, by Starlette's outermost handler (api/errors.py handle_unexpected),
            # which logs the traceback.
            status = status or 500
            scope.setdefault("state", {})[ERROR_STATE] = ErrorBody("internal server error", "server_error",
                                                                   code="internal_error")
            raise
        finally:
            self._log(scope, status or 500, bytes(body), time.monotonic() - began)

    def _log(self, scope: Scope, status: int, body: bytes, seconds: float) -> None:
        state = scope.get("state") or {}
        record = state.get(KEY_STATE)
        key = record.name if record is not None else "-"
        method, path = scope["method"], scope["path"]
        if self.access_log:
            client = scope.get("client")
            access_logger.info("%s %s %s %d key=%s %.3fs", client[0] if client else "-", method, path, status, key,
                               seconds)
        if status < 400 or status == CLIENT_CLOSED:
            return
        error = state.get(ERROR_STATE) or _from_body(status, body)
        message = error.message if len(error.message) <= MAX_LOGGED_MESSAGE else error.message[:MAX_LOGGED_MESSAGE] + "..."
        (logger.warning if status >= 500 else logger.info)(
            "refused %s %s: %d key=%s code=%s param=%s: %s", method, path, status, key, error.code or error.type,
            error.param or "-", message)
        if status != 429:  # NOTE: api/rate_limit.py counts its own refusals, as reason rate_limited
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
        return ErrorBody(str(error.get("message", "")), str(error.get("type") or "error"), error.get("param"),
                         error.get("code"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return ErrorBody(f"HTTP {status}", "error")
