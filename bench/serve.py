"""HTTP load against any OpenAI-compatible endpoint: one streamed request timed from SSE arrival
times, and the closed-loop (`concurrency`) or open-loop (Poisson `request_rate`) driver, every
run bounded in request count and in time."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson

from bench.datasets import Conversation, Turn
from bench.stats import CANCELLED, RequestRecord

ENDPOINTS = ("chat", "completions")


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked (unreachable, no models, rejects a plain request)."""


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    ignore_eos: bool = True  # also sends min_tokens = max_tokens, so outputs have the asked length
    temperature: float | None = 0.0
    extra_body: dict[str, object] = field(default_factory=dict)
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, conv: Conversation, turn: int, answers: Sequence[str]) -> dict[str, object]:
        max_tokens = conv.turns[turn].max_tokens
        body: dict[str, object] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = conv.messages(turn, answers)
        else:
            body["prompt"] = conv.prompt(turn, answers)
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        body.update(self.extra_body)
        return body


@dataclass(frozen=True)
class Load:
    """Closed loop (`concurrency` clients, each sends when its last answer ended) or open loop
    (`request_rate` arrivals per second, Poisson or gamma with `burstiness`, optionally capped at
    `max_concurrency` in flight). Either way at most `num_requests` and `duration_s`."""

    concurrency: int | None = None
    request_rate: float | None = None  # math.inf: everything at t=0
    max_concurrency: int | None = None
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 is Poisson
    num_requests: int = 200
    duration_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("set exactly one of concurrency and request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.num_requests < 1 or not self.duration_s > 0 or not self.burstiness > 0:
            raise ValueError("num_requests, duration_s and burstiness must be positive")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        cap = f",max={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={self.request_rate:g}/s{cap}"


@dataclass(frozen=True)
class RunResult:
    load: Load
    records: tuple[RequestRecord, ...]
    duration_s: float
    interrupted: bool  # stopped early by the caller (Ctrl-C)
    timed_out: bool  # stopped by `duration_s` with requests left


def arrival_times(rate: float, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (seconds from the start) of `n` requests arriving at `rate` per second:
    gamma inter-arrival times of shape `burstiness` and mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id of GET /models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10.0, trust_env=False)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise EndpointError(f"cannot list models at {base_url}/models: {e!r}") from e


@dataclass
class _Stream:
    """What one response stream has shown so far, fed one SSE line at a time (internal and
    mutable: it lives inside one `send_request`)."""

    chat: bool
    chunk_times: list[float] = field(default_factory=list)  # arrivals of output-bearing chunks
    pieces: list[str] = field(default_factory=list)  # the answer's content
    usage: dict[str, Any] | None = None  # parsed JSON
    ended: bool = False  # saw [DONE] or a finish_reason
    error: str | None = None
    message: str | None = None
    event: str = ""

    def feed(self, line: str, now: float) -> bool:
        """Take one line; False once the stream is over ([DONE] or an error event)."""
        if not line:
            self.event = ""  # a blank line ends an SSE event
            return True
        if line.startswith("event:"):
            self.event = line[6:].strip()
        if not line.startswith("data:"):
            return True  # comments (keep-alives), id:, retry:
        data = line[5:].strip()
        if data == "[DONE]":
            self.ended = True
            return False
        obj = orjson.loads(data)
        err = obj.get("error") if isinstance(obj, dict) else obj
        if self.event == "error" or err:
            self.error = "stream_error"
            self.message = str(err.get("message", err) if isinstance(err, dict) else err)
            return False
        self.usage = obj.get("usage") or self.usage
        carries = False
        for choice in obj.get("choices") or ():
            # Reasoning and tool-call deltas are output for timing, but not part of the
            # answer that the next turn carries.
            if self.chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or ""
                carries = carries or bool(
                    piece or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
                )
            else:
                piece = choice.get("text") or ""
                carries = carries or bool(piece)
            self.pieces.append(piece)
            self.ended = self.ended or bool(choice.get("finish_reason"))
        if carries:
            self.chunk_times.append(now)
        return True

    def finish(self) -> None:
        """Judge a stream that ended without an error event."""
        if self.error is not None:
            return
        if not self.ended:
            self.error, self.message = "truncated_stream", "closed without finish_reason or [DONE]"
        elif not self.chunk_times:
            # As vLLM: nothing visible arrived, whatever the server says it generated.
            tokens = (self.usage or {}).get("completion_tokens", "none")
            self.error = "empty_output"
            self.message = f"no output-bearing chunk arrived (usage: {tokens} completion tokens)"

    def record(
        self, index: int, conv: Conversation, turn: int, send_time: float, send: float, end: float | None
    ) -> RequestRecord:
        usage = self.usage or {}
        counted = usage.get("completion_tokens") is None
        times = self.chunk_times
        return RequestRecord(
            index=index,
            send_time=send_time,
            ttft=times[0] - send if times else None,
            itls=tuple(b - a for a, b in zip(times, times[1:])),
            e2e=None if end is None or self.error else end - send,
            prompt_tokens=None if usage.get("prompt_tokens") is None else int(usage["prompt_tokens"]),
            output_tokens=len(times) if counted else int(usage["completion_tokens"]),
            usage_counted=counted,
            error=self.error,
            error_message=self.message,
            conversation_id=conv.conversation_id,
            turn=turn,
            max_tokens=conv.turns[turn].max_tokens,
        )


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    conv: Conversation,
    turn: int,
    answers: Sequence[str],
    index: int,
    t0: float,
    record: Callable[[RequestRecord], None],
) -> str | None:
    """Send one streamed request, hand its record to `record`, return the answer text (None if
    it failed). NOTE: cancellation records the request as cancelled, then propagates."""
    stream = _Stream(chat=target.endpoint == "chat")
    payload = target.payload(conv, turn, answers)
    end: float | None = None
    send = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=payload, headers=target.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:500].decode("utf-8", "replace")
                stream.error, stream.message = f"http_{resp.status_code}", body
            else:
                async for line in resp.aiter_lines():
                    if not stream.feed(line, time.perf_counter()):
                        break
                end = time.perf_counter()
                stream.finish()
    except asyncio.CancelledError:
        stream.error, stream.message = CANCELLED, "cut off by the time bound or an interrupt"
        record(stream.record(index, conv, turn, send - t0, send, None))
        raise
    except (httpx.HTTPError, OSError, orjson.JSONDecodeError) as e:
        stream.error, stream.message = type(e).__name__, str(e)[:500]
    record(stream.record(index, conv, turn, send - t0, send, end))
    return None if stream.error else "".join(stream.pieces)


class _Budget:
    """Hands out request indices until `num_requests` or the deadline."""

    def __init__(self, num_requests: int, deadline: float) -> None:
        self.issued, self._limit, self._deadline = 0, num_requests, deadline

    def take(self) -> int | None:
        if self.issued >= self._limit or time.perf_counter() >= self._deadline:
            return None
        self.issued += 1
        return self.issued - 1


async def run_load(
    target: Target,
    load: Load,
    conversations: Sequence[Conversation],
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Drive `conversations` at `load` until the count, the time bound or `stop` ends the run;
    requests still in flight then are recorded as cancelled."""
    records: list[RequestRecord] = []

    def record(r: RequestRecord) -> None:
        records.append(r)
        if on_record is not None:
            on_record(r)

    # Closed loop: `concurrency` clients bound what is in flight. Open loop: the optional cap
    # holds per request, as vLLM's --max-concurrency does.
    gate = asyncio.Semaphore(load.max_concurrency) if load.request_rate is not None and load.max_concurrency else None

    async def one(client: httpx.AsyncClient, conv: Conversation, turn: int, answers: list[str]) -> str | None:
        index = budget.take()
        if index is None:
            return None
        return await send_request(client, target, conv, turn, answers, index, t0, record)

    async def converse(client: httpx.AsyncClient, conv: Conversation) -> None:
        answers: list[str] = []
        for turn in range(len(conv.turns)):
            if gate is not None:
                async with gate:
                    answer = await one(client, conv, turn, answers)
            else:
                answer = await one(client, conv, turn, answers)
            if answer is None:  # out of budget, or a failed turn ends its conversation
                return
            answers.append(answer)

    async def closed_loop(client: httpx.AsyncClient) -> None:
        todo = iter(conversations)  # shared: each conversation goes to one client

        async def client_loop() -> None:
            for conv in todo:
                if budget.issued >= load.num_requests:
                    return
                await converse(client, conv)

        await asyncio.gather(*(client_loop() for _ in range(load.concurrency or 1)))

    async def open_loop(client: httpx.AsyncClient) -> None:
        assert load.request_rate is not None
        times = arrival_times(load.request_rate, len(conversations), load.seed, load.burstiness)
        tasks: list[asyncio.Task[None]] = []
        try:
            for conv, at in zip(conversations, times):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if budget.issued >= load.num_requests:
                    break
                tasks.append(asyncio.create_task(converse(client, conv)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    cap = load.concurrency or load.max_concurrency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cap or 256)
    timeout = httpx.Timeout(target.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        # NOTE: the clock starts after the client exists: building one costs ~0.1 s (its TLS
        # context), which would otherwise delay the first arrivals of the schedule.
        t0 = time.perf_counter()
        budget = _Budget(load.num_requests, t0 + load.duration_s)
        main = asyncio.ensure_future(closed_loop(client) if load.concurrency is not None else open_loop(client))
        stopped = asyncio.ensure_future((stop or asyncio.Event()).wait())
        try:
            await asyncio.wait({main, stopped}, timeout=load.duration_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut = not main.done()
            interrupted = cut and stopped.done()
            for task in (main, stopped):
                task.cancel()
            await asyncio.gather(main, stopped, return_exceptions=True)
        duration = time.perf_counter() - t0
        if not cut and (exc := main.exception()) is not None:
            raise exc
    records.sort(key=lambda r: r.index)
    return RunResult(load, tuple(records), duration, interrupted, cut and not interrupted)


async def probe_target(target: Target) -> tuple[Target, str | None]:
    """Send one short request before measuring: fail early with the server's message, and drop
    `ignore_eos`/`min_tokens` (with a note) if the server rejects those extensions."""
    probe = Conversation(-1, (Turn("Say hello.", 3, 4),))
    attempts = [target, replace(target, ignore_eos=False)] if target.ignore_eos else [target]
    note = None
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
        for attempt in attempts:
            got: list[RequestRecord] = []
            await send_request(client, attempt, probe, 0, [], -1, time.perf_counter(), got.append)
            if got[0].ok:
                return attempt, note
            if got[0].error not in ("http_400", "http_422"):
                break
            note = f"server rejected ignore_eos/min_tokens ({got[0].error}); output lengths vary"
    raise EndpointError(f"probe request to {target.url} failed: {got[0].error}: {got[0].error_message}")
