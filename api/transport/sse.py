"""Server-sent events: encoding one event with orjson, the `[DONE]` sentinel, and a
streaming response that always closes its event generator (so engine requests get aborted)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Send

DONE = b"data: [DONE]\n\n"

# `X-Accel-Buffering: no` stops nginx-style proxies from buffering the stream into bursts.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: Mapping[str, Any]) -> bytes:
    """One `data:` event. orjson never emits newlines, so one line is always one event."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def encode_error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    """An error after the 200 was sent; the OpenAI SDK raises APIError on a truthy `error` key."""
    return encode_event({"error": {"message": message, "type": type_, "param": None, "code": code}})


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response over an async generator of encoded events.

    NOTE: Starlette cancels the streaming task when the client leaves; if that happens while
    the generator is parked at a `yield` (the task was inside `send`), Starlette never closes
    it, and its `finally` (the engine abort) would wait for garbage collection. Closing it here,
    shielded from that cancellation, frees the request's KV pages at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(events, headers={**SSE_HEADERS, **(headers or {})})
        self._events = events

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
