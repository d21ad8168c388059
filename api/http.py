"""What every handler shares of HTTP itself: the server state on the app, reading a JSON body (with
a size cap and --body-timeout), a JSON response, and noticing a client that left before the
response started (`unless_disconnected`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive

from api.errors import APIError, bad_request

if TYPE_CHECKING:
    from api.state import ServerState

logger = logging.getLogger("fp4serve")

T = TypeVar("T")

# NOTE: an oversized body is still read (and dropped) up to this much more: answering while the
# client is still sending makes the close reset the connection, and the client never sees the 413.
DRAIN_BYTES = 64 << 20


class ClientDisconnected(Exception):
    """The client closed the connection before the response started."""


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, read with a cap (--max-request-bytes; Content-Length may be absent
    or wrong) and within --body-timeout: a slow upload gets a 408; a client that leaves mid-upload
    one INFO line."""
    config = server_state(request).config
    try:
        async with asyncio.timeout(config.body_timeout_s):
            body = await _read_body(request, config.max_request_bytes)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {config.body_timeout_s:g} s (--body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        logger.info("client left while sending the body of %s %s", request.method, request.url.path)
        raise ClientDisconnected() from None
    if not body:
        raise bad_request("request body is empty; send a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    return payload


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        too_big = too_big or size > limit
        if not too_big:
            chunks.append(chunk)
        elif size > limit + DRAIN_BYTES:
            break
    if too_big:
        raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    return b"".join(chunks)


async def wait_for_disconnect(receive: Receive) -> None:
    # NOTE: only call this once the body has been read: every message until then is body.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """`await work`, but cancel it (running its cleanup) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # Let the work's own `finally` (the engine abort) run before we answer.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
