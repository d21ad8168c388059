"""A recording reverse proxy for the agent tests: a Starlette app on hypercorn, in a thread of the
test process, in front of a real fp4serve server. It forwards every request unchanged, streams
the answer back as it comes, and keeps one `Exchange` per request (method, path, status, the
request's JSON body, an error's body), so a test sees exactly what a CLI sent and what it got,
with no change to the server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.server_utils import HTTP, free_port

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx / hypercorn set again themselves.
_DROPPED = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)
ERROR_BODY_BYTES = 4000  # what is kept of a 4xx/5xx body


@dataclass
class Exchange:
    """One request as the proxy saw it."""

    method: str
    path: str
    body: Any  # the parsed JSON body, None when empty or not JSON
    status: int = 0  # 0 until the server answered (a transport failure stays 0)
    error_body: str = ""  # the response body of a 4xx/5xx, cut to ERROR_BODY_BYTES
    started: float = 0.0  # time.monotonic()
    first_byte_s: float | None = None  # time to the first response byte
    done: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # the request's headers

    def summary(self) -> str:
        return f"{self.method} {self.path} -> {self.status} {self.error_body[:600]}"


class RecordingProxy:
    """Forwards http://127.0.0.1:{port}/* to `upstream`; `exchanges` lists every request in order."""

    def __init__(self, upstream: str, rewrite: Callable[[str, Any], Any] | None = None) -> None:
        """`rewrite(path, body)`: a changed JSON body to forward instead (what a server fix would
        accept, to see how far a client gets past a known failure); the recorded body stays the
        client's own."""
        self.upstream = upstream.rstrip("/")
        self.rewrite = rewrite
        self.port = free_port()
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="agent-test-proxy", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def snapshot(self) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges)

    def failures(self) -> list[Exchange]:
        """Every exchange answered 4xx or 5xx, or not answered at all."""
        return [e for e in self.snapshot() if e.status >= 400 or e.status == 0]

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    # ---- the app ------------------------------------------------------------------------------
    def _app(self, client: httpx.AsyncClient) -> Starlette:
        async def forward(request: Request) -> Response:
            raw = await request.body()
            try:
                body = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                body = None
            exchange = Exchange(
                request.method, request.url.path, body, started=time.monotonic(), headers=dict(request.headers)
            )
            with self._lock:
                self.exchanges.append(exchange)
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROPPED]
            if self.rewrite is not None and body is not None:
                raw = orjson.dumps(self.rewrite(request.url.path, body))
            upstream = client.build_request(
                request.method, self.upstream + request.url.path, params=request.url.query, headers=headers, content=raw
            )
            try:
                response = await client.send(upstream, stream=True)
            except httpx.TransportError as e:
                exchange.error_body, exchange.done = f"proxy: upstream unreachable: {e!r}", True
                return Response(exchange.error_body, status_code=502)
            exchange.status = response.status_code
            exchange.first_byte_s = time.monotonic() - exchange.started
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROPPED}
            if response.status_code >= 400:
                content = await response.aread()
                await response.aclose()
                exchange.error_body = content[:ERROR_BODY_BYTES].decode(errors="replace")
                exchange.done = True
                return Response(content, status_code=response.status_code, headers=out_headers)

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()
                    exchange.done = True

            return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

        methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.accesslog = None
        config.errorlog = None
        config.keep_alive_timeout = 75
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        timeout = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=60.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            self._loop.call_soon(self._ready.set)
            await serve(self._app(client), config, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]

    def start(self) -> RecordingProxy:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError("the recording proxy did not start") from self._error
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # hypercorn binds after serve() starts
            try:
                HTTP.get(self.base_url + "/health", timeout=5.0)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError("the recording proxy did not listen within 30 s")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(20)


@contextmanager
def recording_proxy(upstream: str, rewrite: Callable[[str, Any], Any] | None = None) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(upstream, rewrite).start()
    try:
        yield proxy
    finally:
        proxy.stop()
