"""One fix to hypercorn's HTTP/2 protocol, applied once at start-up: request body that arrives for a
stream already answered (a 413 sent at once, a 401, a 429) is taken and dropped for a while, then
the stream is reset with NO_ERROR; the connection and its other streams go on.

NOTE: hypercorn 0.18 (its latest release and main branch) forgets a stream once its response is
sent; a DATA frame the client still sends for it then raises KeyError in
`H2Protocol._handle_events`, which ends the connection with a traceback in the log (and every other
stream on it). RFC 9113 §8.1 lets a server reset such a stream with NO_ERROR at once, and most
clients then stop sending and read the response; but httpx's HTTP/2 client (the OpenAI SDK's
transport) reads nothing before its whole body is sent and would wait on a reset stream until the
connection closed. So the late body is first acknowledged (flow-control credit handed back) and
dropped for up to `late_body_s` (the body timeout), with hypercorn's keep-alive timer restarted on
each frame so that the connection is not closed under a client still sending; only then is the
stream reset. Everything else goes to hypercorn's own handler one event at a time, so a stream the
app closes while earlier events are handled is seen as closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("fp4serve")
_PATCHED = "_fp4serve_takes_late_body"
_LATE = "_fp4serve_late_body_deadlines"  # on each H2Protocol: stream id -> monotonic deadline
_KEPT_ALIVE = "_fp4serve_kept_alive_at"  # on each H2Protocol: when the keep-alive timer last restarted
KEEP_ALIVE_EVERY_S = 1.0  # a restart costs a task: once a second is enough against a 5 s timer


def take_late_body(late_body_s: float) -> None:
    """Wrap `H2Protocol._handle_events`; a later call only changes `late_body_s`."""
    import h2.errors
    import h2.events
    import h2.exceptions
    from hypercorn.events import Updated
    from hypercorn.protocol.h2 import H2Protocol

    current: Callable[[Any, list[Any]], Awaitable[None]] | None = getattr(H2Protocol, "_handle_events", None)
    if current is None:
        logger.warning("hypercorn's HTTP/2 protocol has no _handle_events: late request body is not mended")
        return
    original = getattr(current, _PATCHED, current)

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

    setattr(handle_events, _PATCHED, original)
    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]
