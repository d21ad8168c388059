"""`ClientWatch`: one request's ASGI `receive` and `send`, wrapped so that a client that leaves never
leaves the request hanging, whatever the protocol.

From the moment the response starts, one read of the server's messages is always pending: it drops
request body nobody will read any more (an oversized or unauthorized upload answered early) and
catches the client's `http.disconnect`, after which sends return at once. NOTE: over HTTP/2 the
drain matters: hypercorn queues at most `max_app_queue_size` body messages for an app, and an app
that answered without reading its body then waited forever in its last send (hypercorn puts the
disconnect into that full queue), keeping the request in flight and its key's concurrency slot.
The other HTTP/2 hang, a send after the connection closed, is mended in api/transport/hypercorn_h2.py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import suppress
from typing import Any

from starlette.types import Message, Receive, Scope, Send

DISCONNECT: Message = {"type": "http.disconnect"}


class ClientWatch:
    """Reads the server's messages on demand while the request is read (so a slow upload keeps its
    back-pressure), and continuously once the response has started. Every reader shares the one
    read in progress: the app's body reader, its disconnect watches, and this watch. Touched on
    the event loop only."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._server_receive = receive
        self._server_send = send
        self._messages: deque[Message] = deque()  # read from the server, not yet taken by the app
        self._reader: asyncio.Task[None] | None = None  # the one read in progress
        self._watcher: asyncio.Task[None] | None = None  # reads on from the response's start
        self._responding = False
        self.gone = False  # the client has left

    def _read(self) -> asyncio.Task[None]:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_one())
        return self._reader

    async def _read_one(self) -> None:
        try:
            message = await self._server_receive()
        finally:
            self._reader = None
        if message["type"] == "http.disconnect":
            self.gone = True
        elif not self._responding:
            self._messages.append(message)
        # else: body after the response began, which no route reads: dropped

    async def _watch(self) -> None:
        while not self.gone:
            await asyncio.shield(self._read())

    async def receive(self) -> Message:
        while True:
            if self._messages:
                return self._messages.popleft()
            if self.gone:
                return DISCONNECT
            # Shielded: a receiver that is cancelled (a disconnect watch that lost its race)
            # leaves the read running, and its message for the next receiver.
            await asyncio.shield(self._read())

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self._responding:
            self._responding = True
            self._watcher = asyncio.ensure_future(self._watch())
        if not self.gone:  # nobody is there to read it
            await self._server_send(message)

    async def close(self) -> None:
        """The request is over: stop reading for it."""
        for task in (self._watcher, self._reader):
            if task is None:
                continue
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):  # a failed read ends the watch: retrieved here
                await task
        self._watcher = self._reader = None


async def watched(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app` for one HTTP request under a ClientWatch."""
    watch = ClientWatch(receive, send)
    try:
        await app(scope, watch.receive, watch.send)
    finally:
        await watch.close()
