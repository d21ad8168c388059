"""A raw HTTP/2 client with prior knowledge (h2c) over a blocking socket, driven by hand as an
attacker would drive it: headers, body and reads in any order, flow control honoured or not."""

from __future__ import annotations

import select
import socket
import time
from typing import Any

import h2.config
import h2.connection
import h2.events


class H2:
    """A raw HTTP/2 connection with prior knowledge (h2c), as an attacker would drive it."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()
        self.responses: dict[int, dict[str, Any]] = {}

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def start(self, method: str, path: str, key: str, content_length: int | None = None, end: bool = False) -> int:
        headers = [
            (":method", method),
            (":path", path),
            (":scheme", "http"),
            (":authority", "x"),
            ("authorization", f"Bearer {key}"),
            ("content-type", "application/json"),
        ]
        if content_length is not None:
            headers.append(("content-length", str(content_length)))
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, headers, end_stream=end)
        self.flush()
        self.responses[stream_id] = {"status": None, "body": b"", "ended": False, "reset": False}
        return stream_id

    def send(self, stream_id: int, size: int) -> int:
        """Up to `size` bytes of body, as far as flow control allows now; how many were sent."""
        n = min(size, self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
        if n > 0:
            self.conn.send_data(stream_id, b"x" * n)
            self.flush()
        return n

    def pump(self, wait_s: float) -> None:
        ready, _, _ = select.select([self.sock], [], [], wait_s)
        if not ready:
            return
        data = self.sock.recv(1 << 20)
        assert data, "the server closed the connection"
        for event in self.conn.receive_data(data):
            response = self.responses.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.ResponseReceived) and response is not None:
                response["status"] = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived) and response is not None:
                response["body"] += event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and response is not None:
                response["ended"] = True
            elif isinstance(event, h2.events.StreamReset) and response is not None:
                response["reset"] = True
        self.flush()

    def wait_response(self, stream_id: int, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.responses[stream_id]["ended"]:
            assert time.monotonic() < deadline, f"no response on stream {stream_id}: {self.responses[stream_id]}"
            self.pump(0.1)
        return self.responses[stream_id]

    def close(self) -> None:
        self.sock.close()
