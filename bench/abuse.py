"""The abusive clients of `bench soak --abuse` (issue 32's probe, as a careless client or an attacker
on the team's network would behave): each is one async function that does its one bad thing and
returns how the server answered, as a short label ("huge_enum 200", "smuggle 400+closed"), or a
label starting with "FAIL" when the server did what it must never do (run a smuggled request,
answer 5xx). Raw HTTP/1.1 and HTTP/2 (h2c) are spoken here by hand where a client library would
refuse to send the bad request."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import httpx
import orjson

ENUM_SIZE = 10_000  # the probe's schema: each compiles to tens of MiB against a 150k vocabulary
DEEP = 300  # levels of nesting: past the 64 a response_format may have
DECLARED_BYTES = 100_000_000  # what an oversized request says it will send
OVERSIZE_SEND_BYTES = 8 << 20  # what it then sends at most, so the soak does not measure its own upload


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    model: str
    key: str  # the abusers' key (with rpm / tpm / max_concurrent limits)
    victim_key: str  # a well-behaved key: a smuggled request would spend its quota

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _status(kind: str, status: int) -> str:
    return f"FAIL {kind} {status}" if status >= 500 and status != 503 else f"{kind} {status}"


def _chat(target: Target, **extra: object) -> dict[str, object]:
    return {"model": target.model, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 16, **extra}


async def huge_enum(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    """A response_format whose enum has ENUM_SIZE fresh values: a new grammar to compile each time."""
    salt = rng.randrange(1 << 40)
    schema = {
        "type": "object",
        "properties": {"v": {"enum": [f"{salt:x}-option-{i}" for i in range(ENUM_SIZE)]}},
        "required": ["v"],
    }
    body = _chat(target, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    r = await client.post("/v1/chat/completions", json=body, headers=target.auth)
    return _status("huge_enum", r.status_code)


async def deep_schema(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    """Schemas nested DEEP levels, in response_format or in a tool's parameters."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(DEEP):
        schema = {"type": "object", "properties": {"x": schema}}
    if rng.random() < 0.5:
        body = _chat(target, response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})
        kind = "deep_schema"
    else:
        body = _chat(
            target,
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
            tool_choice="required",
        )
        kind = "deep_tool"
    r = await client.post("/v1/chat/completions", json=body, headers=target.auth)
    return _status(kind, r.status_code)


async def burst(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    """Twenty requests at once: past the key's rate and concurrency limits."""
    replies = await asyncio.gather(
        *(
            client.post(
                "/v1/completions", headers=target.auth, json={"model": target.model, "prompt": "hi", "max_tokens": 4}
            )
            for _ in range(20)
        ),
        return_exceptions=True,
    )
    statuses = sorted({r.status_code for r in replies if isinstance(r, httpx.Response)})
    bad = [s for s in statuses if s >= 500 and s != 503]
    refused = [r for r in replies if isinstance(r, httpx.Response) and r.status_code == 429]
    if any("retry-after" not in r.headers for r in refused):
        return "FAIL burst 429 without Retry-After"
    return f"FAIL burst {bad}" if bad else f"burst {'/'.join(map(str, statuses))}"


# ---- raw HTTP/1.1 ----------------------------------------------------------------------------------------
def _head(target: Target, key: str, framing: str, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {target.host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n"
    ).encode()


async def _read_all(reader: asyncio.StreamReader, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sends until it closes (True) or `timeout_s` passes (False)."""
    data = b""
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                data += chunk
        return data, True
    except TimeoutError:
        return data, False
    except ConnectionError:
        return data, True


async def smuggle(target: Target, rng: random.Random) -> str:
    """Content-Length and Transfer-Encoding at once, a second request (on the victim's key) hidden in
    the body: if that one runs, a second response comes back on the connection."""
    inner = orjson.dumps({"model": target.model, "prompt": "smuggled", "max_tokens": 1})
    hidden = _head(target, target.victim_key, f"Content-Length: {len(inner)}\r\n", "/v1/completions") + inner
    body = b"0\r\n\r\n" + hidden
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(_head(target, target.key, f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n") + body)
        await writer.drain()
        data, closed = await _read_all(reader, 30.0)
    finally:
        writer.close()
    if data.count(b"HTTP/1.1 ") > 1:
        return "FAIL smuggle: the hidden request ran"
    status = data[9:12].decode(errors="replace") or "none"
    return f"smuggle {status}{'+closed' if closed else '+open'}"


async def oversized_h1(target: Target, rng: random.Random) -> str:
    """Declares DECLARED_BYTES and sends what it can of OVERSIZE_SEND_BYTES, then reads the answer."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(_head(target, target.key, f"Content-Length: {DECLARED_BYTES}\r\n"))
        chunk, sent = b" " * 65536, 0
        try:
            while sent < OVERSIZE_SEND_BYTES and not reader.at_eof():
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5.0)
                sent += len(chunk)
        except (ConnectionError, TimeoutError):
            pass
        data, _ = await _read_all(reader, 30.0)
    finally:
        writer.close()
    # NOTE: an HTTP/1.1 answer sent while the body still comes (a 429 before the body is read) is often
    # lost: the server closes, the client's next write is reset before it reads.
    return _status("oversized_h1", int(data[9:12])) if data[9:12].isdigit() else "oversized_h1 closed"


async def slowloris(target: Target, rng: random.Random) -> str:
    """A body that trickles in, a byte a second, until the server gives up on it."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(_head(target, target.key, "Content-Length: 4096\r\n"))
        await writer.drain()
        start = time.monotonic()
        while not reader.at_eof() and time.monotonic() - start < 120:
            try:
                data = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                writer.write(b" ")
                await writer.drain()
                continue
            if data:
                return _status("slowloris", int(data[9:12])) if data[9:12].isdigit() else "slowloris garbled"
    except ConnectionError:
        pass
    finally:
        writer.close()
    return "slowloris closed"


# ---- raw HTTP/2 (h2c, prior knowledge) ----------------------------------------------------------------------
async def oversized_h2(target: Target, rng: random.Random) -> str:
    """Declares DECLARED_BYTES over HTTP/2, sends a little, reads the answer, leaves; half the time it
    leaves before any answer, as the probe's client did."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(
        stream_id,
        [
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":scheme", "http"),
            (":authority", target.host),
            ("authorization", f"Bearer {target.key}"),
            ("content-type", "application/json"),
            ("content-length", str(DECLARED_BYTES)),
        ],
    )
    conn.send_data(stream_id, b" " * 16384)
    status = "left"
    try:
        writer.write(conn.data_to_send())
        await writer.drain()
        if rng.random() < 0.5:
            async with asyncio.timeout(30.0):
                while status == "left":
                    data = await reader.read(65536)
                    if not data:
                        break
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ResponseReceived):
                            status = dict(event.headers)[b":status"].decode()
                    writer.write(conn.data_to_send())
    except (TimeoutError, ConnectionError):
        status = "no answer"
    finally:
        writer.close()
    return f"FAIL oversized_h2 {status}" if status.startswith("5") else f"oversized_h2 {status}"


Abuse = Callable[[httpx.AsyncClient, Target, random.Random], Awaitable[str]]


def _raw(fn: Callable[[Target, random.Random], Awaitable[str]]) -> Abuse:
    async def run(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
        return await fn(target, rng)

    return run


# name -> (how often, the client)
ABUSES: dict[str, tuple[int, Abuse]] = {
    "huge_enum": (3, huge_enum),
    "deep_schema": (2, deep_schema),
    "burst": (2, burst),
    "smuggle": (2, _raw(smuggle)),
    "oversized_h1": (1, _raw(oversized_h1)),
    "oversized_h2": (2, _raw(oversized_h2)),
    "slowloris": (1, _raw(slowloris)),
}
