"""`FramingMiddleware`: how a request's body is framed and sized, checked before any route runs.

- HTTP/1.x: a request with both `Content-Length` and `Transfer-Encoding` is refused with 400 and
  the connection is closed (RFC 9112 §6.3). NOTE: h11 lets such a request through (chunked wins,
  as the RFC says a recipient may) and keeps the connection open, so the bytes a
  Content-Length-framing proxy sent as this request's body would run here as a second request:
  request smuggling.
- HTTP/2 and later: a declared `content-length` above `--max-request-bytes` gets its 413 at once,
  and a body that streams past it gets the 413 as soon as it does. HTTP/2 can answer a stream and
  reset it while the client still sends, with no harm to the connection. HTTP/1.1 bodies are
  drained by the route instead (api/routes.py), so that the client reads its 413 before the close.

Its refusals are logged and counted by RequestLogMiddleware (api/access/request_log.py), which sits
outside it: one line and one count per refused request.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.error_shape import shaped
from api.errors import APIError, error_response

HTTP1 = ("1.0", "1.1")


def too_large_message(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes"


class FramingMiddleware:
    """Pure ASGI; `max_request_bytes` is ServerConfig's."""

    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.limit = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if scope.get("http_version") in HTTP1:
            if any(k == b"transfer-encoding" for k, _ in headers) and any(k == b"content-length" for k, _ in headers):
                await self._refuse(
                    scope,
                    receive,
                    send,
                    400,
                    "ambiguous_framing",
                    "the request has both Content-Length and Transfer-Encoding, which RFC 9112 "
                    "forbids; send one of them (the connection is closed)",
                    {"Connection": "close"},
                )
                return
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in headers if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, 413, "request_too_large", too_large_message(self.limit), {})
            return
        await self.app(scope, self._capped(receive), send)

    def _capped(self, receive: Receive) -> Receive:
        """`receive`, raising the 413 (APIError, answered by the route's handlers) once the body
        has grown past the limit."""
        size = 0

        async def capped_receive() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.limit:
                    raise APIError(413, too_large_message(self.limit), code="request_too_large")
            return message

        return capped_receive

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, code: str, message: str, headers: dict[str, str]
    ) -> None:
        await shaped(scope, error_response(status, message, code=code, headers=headers))(scope, receive, send)
