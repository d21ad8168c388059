"""Two fixes to hypercorn's HTTP/2 protocol (`H2Protocol`), applied once at start-up by api/server.py.
hypercorn 0.18 is its latest release, and its main branch has both faults.

1. A lost connection left its streams' send buffers open: a response sent after that waited for
   the buffer to drain, which never happened (the sender task had stopped), so the request stayed
   in flight with its key's concurrency slot, and shutdown waited for it into a traceback. Now the
   buffers are closed with the connection, and such a send returns.
2. hypercorn forgets a stream once its response is sent; a DATA frame the client still sends for it
   (after an early 413, 401 or 429) raised KeyError in `_handle_events`, which ended the whole
   connection with a traceback in the log. RFC 9113 §8.1 lets a server reset such a stream with
   NO_ERROR at once, and most clients then stop sending and read the response; but httpx's HTTP/2
   client (the OpenAI SDK's transport) reads nothing before its whole body is sent and would wait
   on a reset stream until the connection closed. So the late body is acknowledged (its
   flow-control credit handed back) and dropped for up to `late_body_s` (the body timeout), with
   the keep-alive timer restarted now and then so that the connection is not closed under a client
   still sending; only then is the stream reset. Other events go to hypercorn's handler one at a
   time, so a stream the app closes while earlier events are handled is seen as closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("fp4serve")
_ORIGINAL = "_fp4serve_original"  # on each wrapper: hypercorn's own method
_LATE = "_fp4serve_late_body_deadlines"  # on each H2Protocol: stream id -> monotonic deadline
_KEPT_ALIVE = "_fp4serve_kept_alive_at"  # on each H2Protocol: when the keep-alive timer last restarted
KEEP_ALIVE_EVERY_S = 1.0  # a restart costs a task: once a second is enough against a 5 s timer

Method = Callable[..., Awaitable[None]]


def mend_hypercorn_h2(late_body_s: float) -> None:
    """Wrap `H2Protocol.handle` and `H2Protocol._handle_events`; a later call only changes
    `late_body_s` (the wrappers always wrap hypercorn's own methods)."""
    from hypercorn.protocol.h2 import H2Protocol

    originals = {
        name: getattr(getattr(H2Protocol, name, None), _ORIGINAL, getattr(H2Protocol, name, None))
        for name in ("handle", "_handle_events")
    }
    if None in originals.values():
        logger.warning(
            "hypercorn's HTTP/2 protocol has changed: its lost-connection and late-body faults are not mended"
        )
        return
    for name, wrapper in (
        ("handle", _closing_buffers(originals["handle"])),
        ("_handle_events", _taking_late_body(originals["_handle_events"], late_body_s)),
    ):
        setattr(wrapper, _ORIGINAL, originals[name])
        setattr(H2Protocol, name, wrapper)


def _closing_buffers(original: Method) -> Method:
    from hypercorn.events import Closed

    async def handle(self: Any, event: Any) -> None:
        await original(self, event)
        if isinstance(event, Closed):
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()  # sends waiting on it return; later ones find it complete

    return handle


def _taking_late_body(original: Method, late_body_s: float) -> Method:
    import h2.errors
    import h2.events
    import h2.exceptions
    from hypercorn.events import Updated

    async def late_data(self: Any, event: Any) -> None:
        self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        deadlines: dict[int, float] = self.__dict__.setdefault(_LATE, {})
        now = time.monotonic()
        deadline = deadlines.setdefault(event.stream_id, now + late_body_s)
        if now > deadline:
            deadlines.pop(event.stream_id)
            try:
                self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
            except h2.exceptions.StreamClosedError:
                pass  # reset already: frames the client sent before it saw the reset
        elif self.idle and now - self.__dict__.get(_KEPT_ALIVE, 0.0) >= KEEP_ALIVE_EVERY_S:
            self.__dict__[_KEPT_ALIVE] = now
            await self.send(Updated(idle=True))  # restarts the keep-alive timer from now
        await self._flush()

    async def handle_events(self: Any, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                await late_data(self, event)
                continue
            if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                self.__dict__.get(_LATE, {}).pop(event.stream_id, None)
            await original(self, [event])

    return handle_events
