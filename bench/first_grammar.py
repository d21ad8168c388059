"""`bench serve --scenario first-grammar`: does the first constrained request stall other streams?
A plain streamed chat request runs and, once it streams, a plain request of the same shape arrives
(its prefill joins the batch: the baseline); then a second stream runs and the server's first
constrained request arrives (the same request with a response_format json_schema no request used
before). Reported: each stream's largest inter-token gap from the arrival on, and their ratio. Run
it against a freshly started server (docs/PERF.md)."""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


@dataclass(frozen=True)
class Scenario:
    base_url: str
    model: str
    api_key: str | None
    stream_tokens: int = 200  # tokens of each plain stream
    constrained_after: int = 40  # tokens the second stream has sent when the constrained request goes
    temperature: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("first-grammar scenario (--scenario first-grammar)")
    g.add_argument("--stream-tokens", type=int, default=200, help="output tokens of each plain stream")
    g.add_argument(
        "--constrained-after",
        type=int,
        default=40,
        help="tokens the second stream has sent when the first constrained request is sent",
    )


def scenario_from_args(args: argparse.Namespace, model: str) -> Scenario:
    return Scenario(args.base_url, model, args.api_key, args.stream_tokens, args.constrained_after, args.temperature)


def _headers(s: Scenario) -> dict[str, str]:
    return {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}


async def _plain_stream(client: httpx.AsyncClient, s: Scenario, reached: asyncio.Event | None) -> list[float]:
    """One streamed chat request of `stream_tokens` tokens; the arrival time of each content chunk.
    Sets `reached` once `constrained_after` chunks have arrived."""
    body = {
        "model": s.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": s.stream_tokens,
        "min_tokens": s.stream_tokens,
        "ignore_eos": True,
        "temperature": s.temperature,
    }
    times: list[float] = []
    async with client.stream("POST", "/chat/completions", json=body, headers=_headers(s)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
                if reached is not None and len(times) == s.constrained_after:
                    reached.set()
    return times


async def _arrival(
    client: httpx.AsyncClient, s: Scenario, reached: asyncio.Event, constrained: bool
) -> tuple[float, float]:
    """After `reached`: a short request, with a json_schema no earlier request used when
    `constrained`; (sent, answered) times."""
    await reached.wait()
    name = "k" + uuid.uuid4().hex[:8]  # a schema never compiled before: nothing cached helps it
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    body: dict[str, Any] = {
        "model": s.model,
        "messages": [{"role": "user", "content": f"A number, as JSON, in {name}."}],
        "max_tokens": 16,
        "temperature": s.temperature,
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    sent = time.perf_counter()
    response = await client.post("/chat/completions", json=body, headers=_headers(s))
    response.raise_for_status()
    return sent, time.perf_counter()


def _largest_gap_ms(times: list[float], since: float = 0.0) -> float:
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= since]
    return 1000 * max(gaps, default=0.0)


async def run(s: Scenario) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=s.base_url, timeout=600) as client:
        reached = asyncio.Event()
        plain, (plain_sent, _) = await asyncio.gather(
            _plain_stream(client, s, reached), _arrival(client, s, reached, constrained=False)
        )
        reached = asyncio.Event()
        during, (sent, answered) = await asyncio.gather(
            _plain_stream(client, s, reached), _arrival(client, s, reached, constrained=True)
        )
    without = _largest_gap_ms(plain, since=plain_sent)
    with_it = _largest_gap_ms(during, since=sent)
    return {
        "stream_tokens": s.stream_tokens,
        "largest_gap_ms_without": round(without, 1),
        "largest_gap_ms_with_first_constrained": round(with_it, 1),
        "ratio": round(with_it / without, 2) if without else None,
        "constrained_request_s": round(answered - sent, 3),
    }


def format_result(result: dict[str, Any]) -> str:
    return (
        f"plain stream of {result['stream_tokens']} tokens, largest inter-token gap: "
        f"{result['largest_gap_ms_without']} ms while a plain request arrived, {result['largest_gap_ms_with_first_constrained']} ms "  # noqa: E501
        f"while the server's first constrained request ran ({result['ratio']}x); that request took "
        f"{result['constrained_request_s']} s"
    )
