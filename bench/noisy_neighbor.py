"""`bench serve --scenario noisy-neighbor`: one API key floods the server far past its batch slots
with long prompts while another sends short interactive requests; each key's TTFT percentiles.
Run it against a server started with --scheduling-policy fcfs and fair to compare (docs/PERF.md).

Prompts are token-id lists on /v1/completions (no tokenizer needed here); outputs have their
asked length (ignore_eos)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


@dataclass(frozen=True)
class Scenario:
    base_url: str
    model: str
    flood_key: str | None
    interactive_key: str | None
    flood_requests: int = 40
    flood_prompt_len: int = 512
    flood_output_len: int = 32
    interactive_requests: int = 10
    interactive_prompt_len: int = 16
    interactive_output_len: int = 8
    interactive_interval_s: float = 0.5
    interactive_delay_s: float = 1.0  # the flood is queued before the first interactive request
    seed: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("noisy-neighbor scenario (--scenario noisy-neighbor)")
    g.add_argument("--flood-api-key", help="the flooding key (default: --api-key)")
    g.add_argument("--interactive-api-key", help="the interactive key (default: --api-key)")
    g.add_argument("--flood-requests", type=int, default=40, help="long requests sent at once by the flooding key")
    g.add_argument("--flood-prompt-len", type=int, default=512, help="prompt tokens of each flood request")
    g.add_argument("--flood-output-len", type=int, default=32, help="output tokens of each flood request")
    g.add_argument("--interactive-requests", type=int, default=10, help="short requests of the interactive key")
    g.add_argument("--interactive-interval", type=float, default=0.5, help="seconds between interactive requests")


def scenario_from_args(args: argparse.Namespace, model: str) -> Scenario:
    return Scenario(
        base_url=args.base_url,
        model=model,
        flood_key=args.flood_api_key or args.api_key,
        interactive_key=args.interactive_api_key or args.api_key,
        flood_requests=args.flood_requests,
        flood_prompt_len=args.flood_prompt_len,
        flood_output_len=args.flood_output_len,
        interactive_requests=args.interactive_requests,
        interactive_interval_s=args.interactive_interval,
        seed=args.seed,
    )


async def _one(client: httpx.AsyncClient, s: Scenario, key: str | None, prompt: list[int], max_tokens: int) -> float:
    """TTFT in seconds (NaN on an error)."""
    body = {
        "model": s.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    ttft = float("nan")
    async with client.stream("POST", s.base_url.rstrip("/") + "/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return ttft
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and ttft != ttft:
                if orjson.loads(line[6:])["choices"]:
                    ttft = time.perf_counter() - start
    return ttft


async def run(s: Scenario) -> dict[str, Any]:
    rng = random.Random(s.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    limits = httpx.Limits(max_connections=s.flood_requests + s.interactive_requests + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        flood = [
            asyncio.create_task(_one(client, s, s.flood_key, prompt(s.flood_prompt_len), s.flood_output_len))
            for _ in range(s.flood_requests)
        ]
        await asyncio.sleep(s.interactive_delay_s)
        interactive = []
        for _ in range(s.interactive_requests):
            interactive.append(
                asyncio.create_task(
                    _one(client, s, s.interactive_key, prompt(s.interactive_prompt_len), s.interactive_output_len)
                )
            )
            await asyncio.sleep(s.interactive_interval_s)
        flood_ttft = await asyncio.gather(*flood)
        interactive_ttft = await asyncio.gather(*interactive)
    return {"flood": summarize(flood_ttft), "interactive": summarize(interactive_ttft)}


def summarize(ttfts: list[float]) -> dict[str, float]:
    ok = sorted(t for t in ttfts if t == t)
    if not ok:
        return {"n": 0, "errors": len(ttfts)}

    def pct(p: float) -> float:
        return ok[min(int(p / 100 * len(ok)), len(ok) - 1)]

    return {
        "n": len(ok),
        "errors": len(ttfts) - len(ok),
        "mean": statistics.fmean(ok),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ok[-1],
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"{'key':<12} {'n':>4} {'err':>4} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}  (TTFT, s)"]
    for key, row in result.items():
        if not row.get("n"):
            lines.append(f"{key:<12} {0:>4} {row.get('errors', 0):>4}")
            continue
        lines.append(
            f"{key:<12} {row['n']:>4} {row['errors']:>4} {row['mean']:>8.3f} {row['p50']:>8.3f} "
            f"{row['p90']:>8.3f} {row['p99']:>8.3f}"
        )
    f, i = result["flood"].get("mean"), result["interactive"].get("mean")
    if f and i:
        lines.append(f"interactive / flood mean TTFT: {i / f:.3f}")
    return "\n".join(lines)
