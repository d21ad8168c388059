"""api/transport/client_watch.py: every reader of a request shares one read of the server's messages, a
receiver that gives up loses nothing, a client's disconnect is seen by all and later sends are
dropped; and under hypercorn over HTTP/2, an app that answers without reading a body the client
keeps sending still finishes (its last send used to wait on the full queue of unread body)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.transport.client_watch import DISCONNECT, ClientWatch
from api.transport.hypercorn_h2 import mend_hypercorn_h2
from api.transport.inflight import InFlight, InFlightMiddleware
from api.transport.metrics import ServerMetrics
from tests.h2_client import H2
from tests.server_utils import free_port

FRAME = 16384  # DATA frame size
# hypercorn's max_app_queue_size (10 by default) made 2: two frames fill it, and h2 hands their
# flow-control credit back at once (it waits for half the 64 KiB window), which the client sees.
APP_QUEUE = 2
WINDOW = 65535


class FakeServer:
    """The server side of an ASGI request: messages the test puts, sends it records."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def test_readers_share_one_read_and_a_cancelled_one_loses_nothing() -> None:
    async def main() -> None:
        server = FakeServer()
        watch = ClientWatch(server.receive, server.send)
        impatient = asyncio.ensure_future(watch.receive())
        await asyncio.sleep(0)
        impatient.cancel()  # a disconnect watch that lost its race
        server.inbox.put_nowait({"type": "http.request", "body": b"a", "more_body": True})
        server.inbox.put_nowait({"type": "http.request", "body": b"b", "more_body": False})
        assert [(await watch.receive())["body"] for _ in range(2)] == [b"a", b"b"]
        await watch.close()

    asyncio.run(main())


def test_a_disconnect_reaches_every_reader_and_later_sends_are_dropped() -> None:
    async def main() -> None:
        server = FakeServer()
        watch = ClientWatch(server.receive, server.send)
        await watch.send({"type": "http.response.start", "status": 200, "headers": []})
        server.inbox.put_nowait({"type": "http.request", "body": b"late", "more_body": True})  # dropped
        server.inbox.put_nowait(DISCONNECT)
        assert await asyncio.gather(watch.receive(), watch.receive()) == [DISCONNECT, DISCONNECT]
        await watch.send({"type": "http.response.body", "body": b"x", "more_body": False})
        assert watch.gone and [m["type"] for m in server.sent] == ["http.response.start"]
        await watch.close()

    asyncio.run(main())


class Hypercorn:
    """`InFlightMiddleware(app)` under hypercorn (HTTP/2 mended as api/server.py does) on a thread."""

    def __init__(self, app: Any, max_app_queue_size: int = 10) -> None:
        from hypercorn.config import Config

        self.port = free_port()
        self.in_flight = InFlight(None, ServerMetrics())
        self.app = InFlightMiddleware(app, self.in_flight)
        self.config = Config()
        self.config.bind = [f"127.0.0.1:{self.port}"]
        self.config.accesslog = None
        self.config.max_app_queue_size = max_app_queue_size
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve

        mend_hypercorn_h2(30.0)
        await serve(self.app, self.config, shutdown_trigger=self.stop.wait)  # type: ignore[arg-type]

    def __enter__(self) -> Hypercorn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                H2(self.port).close()
                return self
            except OSError:
                assert time.monotonic() < deadline, "hypercorn did not start"
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture()
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def test_an_app_answering_late_without_reading_the_body_finishes_over_http2(gate: threading.Event) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.to_thread(gate.wait)  # answers only once the client has filled hypercorn's queue
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too large", "more_body": False})

    with Hypercorn(app, max_app_queue_size=APP_QUEUE) as server:
        client = H2(server.port)
        stream_id = client.start("POST", "/v1/x", "k", content_length=100 * FRAME)
        for _ in range(APP_QUEUE):
            assert client.send(stream_id, FRAME) == FRAME
        # The credit comes back once hypercorn has queued both frames for the app: its queue is full.
        deadline = time.monotonic() + 30
        while client.conn.local_flow_control_window(stream_id) < WINDOW - FRAME:
            assert time.monotonic() < deadline, "hypercorn never queued the body"
            client.pump(0.05)
        gate.set()
        response = client.wait_response(stream_id)
        assert (response["status"], response["body"]) == (413, b"too large")
        deadline = time.monotonic() + 30
        while server.in_flight.count:
            assert time.monotonic() < deadline, "the request is still in flight"
            time.sleep(0.01)
        client.close()
