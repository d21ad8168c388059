"""`ClientWatch`: one request's ASGI `receive` and `send`, wrapped so that a client that leaves
never leaves the request hanging, whatever the protocol.

NOTE: hypercorn's HTTP/2 sender stops when the connection closes, but a response message sent
after that waits for the stream's buffer to drain, which never happens: the request's task, its
in-flight count and its key's concurrency slot stayed forever. So each `send` races the client's
`http.disconnect`: once the client is gone, a pending send is cancelled and later ones return at
once (nobody is there to read them), and the request ends through its own `finally` blocks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import suppress
from typing import Any

from starlette.types import Message, Receive, Send

DISCONNECT: Message = {"type": "http.disconnect"}


class ClientWatch:
    """Reads the server's messages on demand only: while the app waits in `receive`, or while one
    of its sends is pending (to see a disconnect); so a slow upload keeps its back-pressure. Body
    that arrives after the response began is dropped: no route reads a body after answering (an
    oversized or late upload is answered and abandoned). Touched on the event loop only."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._server_receive = receive
        self._server_send = send
        self._messages: deque[Message] = deque()  # read from the server, not yet taken by the app
        self._reader: asyncio.Task[None] | None = None  # the one read in progress
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
        if message["type"] == "http.response.start":
            self._responding = True
        if self.gone:
            return
        sending = asyncio.ensure_future(self._server_send(message))
        try:
            while not sending.done():
                reading = self._read()
                await asyncio.wait({sending, reading}, return_when=asyncio.FIRST_COMPLETED)
                if self.gone and not sending.done():
                    return  # the finally cancels the send that would never complete
                if reading.done() and not reading.cancelled() and reading.exception() is not None:
                    await sending  # the server's receive failed: nothing more to watch
        finally:
            if not sending.done():
                sending.cancel()
                with suppress(asyncio.CancelledError):
                    await sending
        sending.result()

    async def close(self) -> None:
        """The request is over: stop reading for it."""
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await reader


async def watched(app: Any, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Run `app` for one HTTP request under a ClientWatch."""
    watch = ClientWatch(receive, send)
    try:
        await app(scope, watch.receive, watch.send)
    finally:
        await watch.close()
