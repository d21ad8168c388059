"""`python -m bench soak`: an endpoint under mixed traffic for a while — greedy and sampled
requests, invalid ones, clients that walk away mid-stream — then checks that nothing was lost or
leaked: every greedy answer equals the reference taken alone at the start, every refusal is an
OpenAI-shaped 4xx (or a 503 with Retry-After), and once idle the server runs nothing and holds no
KV page, with its resident memory flat. Prints one screen; exits 1 on any failure. With --abuse:
well-behaved streams beside abusive clients instead (bench/abuse_soak.py)."""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.abuse_soak import add_abuse_arguments, cmd_abuse_soak
from bench.serve import EndpointError, discover_model
from bench.spawned import SPAWN_ARGS, SpawnedServer

PROMPTS = ("Tell me about the sea.", "Count to ten.", "Write a haiku about rust.", "What is a KV cache?")
HELLO = [{"role": "user", "content": "Say hello."}]
# Each is refused with a 4xx by any OpenAI-compatible server: (endpoint, JSON body or raw bytes).
INVALID: tuple[tuple[str, Any], ...] = (
    ("chat", b'{"messages": [{"role": "user", "content": "hi"'),
    ("chat", b"null"),
    ("chat", {"messages": []}),
    ("chat", {"messages": HELLO, "temperature": "hot"}),
    ("chat", {"messages": HELLO, "n": 0}),
    ("chat", {"messages": HELLO, "top_p": 7}),
    ("chat", {"messages": HELLO, "model": "no-such-model"}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": [-1]}),
    ("completions", {"prompt": "hi", "max_tokens": -1}),
)
WEIGHTS = {"greedy": 4, "sampled": 2, "invalid": 2, "disconnect": 2}


@dataclass(frozen=True)
class SoakConfig:
    base_url: str  # ends in /v1
    model: str
    duration_s: float = 60.0
    concurrency: int = 12
    max_tokens: int = 8
    seed: int = 0
    max_rss_growth_mib: float = 64.0
    settle_s: float = 10.0  # how long the server may take to go idle after the traffic stops
    request_timeout_s: float = 120.0
    api_key: str | None = None


@dataclass
class Tally:
    """Outcomes by kind; `problems` holds one line per failed check."""

    counts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.counts["failed"] += 1
        self.problems.append(what)


@dataclass(frozen=True)
class EndState:
    num_running: float | None  # None: the server exposes no fp4serve metrics
    num_waiting: float | None
    kv_pages_held: float | None
    settled_s: float
    rss_warm: int | None  # bytes, once warmed up
    rss_end: int | None
    rss_source: str
    exit_code: int | None = None  # of a spawned server after SIGTERM


@dataclass(frozen=True)
class SoakReport:
    config: SoakConfig
    tally: Tally
    end: EndState
    server: str  # "spawned, pid N" or "external"

    def failures(self) -> list[str]:
        out = list(self.tally.problems)
        end, limit = self.end, self.config.max_rss_growth_mib
        if self.tally.counts["greedy"] == 0:
            out.append("no greedy answer was checked (all refused?)")
        for name, value in (
            ("running", end.num_running),
            ("waiting", end.num_waiting),
            ("KV pages held", end.kv_pages_held),
        ):
            if value:
                out.append(f"{name} is {value:g} after {end.settled_s:.1f} s idle (expected 0)")
        if end.rss_warm is not None and end.rss_end is not None and (end.rss_end - end.rss_warm) / 2**20 > limit:
            out.append(f"resident memory grew {(end.rss_end - end.rss_warm) / 2**20:.1f} MiB (limit {limit:g} MiB)")
        if end.exit_code not in (None, 0):
            out.append(f"the spawned server exited {end.exit_code} after SIGTERM (expected 0)")
        return out


def format_report(report: SoakReport) -> str:
    c, t, end = report.config, report.tally.counts, report.end
    total = sum(t[k] for k in ("ok", "greedy", "refused", "overloaded", "disconnected", "failed"))
    growth = (
        "n/a" if end.rss_warm is None or end.rss_end is None else f"{(end.rss_end - end.rss_warm) / 2**20:+.1f} MiB"
    )
    idle = (
        "n/a (no fp4serve metrics)"
        if end.num_running is None
        else (
            f"running {end.num_running:g}, waiting {end.num_waiting:g}, KV pages held {end.kv_pages_held:g} "
            f"(after {end.settled_s:.1f} s)"
        )
    )
    lines = [
        f"soak: {c.duration_s:g} s, {c.concurrency} clients, seed {c.seed}, {c.base_url} ({report.server}), {c.model}",
        f"traffic    {total} requests: {t['greedy'] + t['ok']} served, {t['refused']} refused (4xx), "
        f"{t['overloaded']} overloaded (503), {t['disconnected']} walked away, {t['failed']} failed",
        f"greedy     {t['greedy']} answers equal to the reference",
        f"idle       {idle}",
        f"memory     RSS {_mib(end.rss_warm)} warm, {_mib(end.rss_end)} at the end: {growth} "
        f"(limit +{c.max_rss_growth_mib:g} MiB; from {end.rss_source})",
    ]
    if end.exit_code is not None:
        lines.append(f"server     exited {end.exit_code} after SIGTERM")
    failures = report.failures()
    lines += [f"  FAIL {f}" for f in failures[:10]] + (
        [f"  ... {len(failures) - 10} more"] if len(failures) > 10 else []
    )
    lines.append("FAIL" if failures else "PASS")
    return "\n".join(lines)


def _mib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


# ---- traffic -------------------------------------------------------------------------------------------
def chat_body(config: SoakConfig, prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": config.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": config.max_tokens,
        "ignore_eos": True,
        **extra,
    }


def sse_events(lines: list[str]) -> list[Any]:
    return [ln[6:] if ln[6:] == "[DONE]" else orjson.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


@dataclass(frozen=True)
class Outcome:
    kind: str  # greedy | ok | refused | overloaded | disconnected | failed
    problem: str | None = None
    retry_after_s: float = 0.0


def refusal(status: int, headers: httpx.Headers, body: bytes, what: str) -> Outcome:
    """A 4xx, or a 503 with Retry-After, in OpenAI's error shape is fine; anything else fails."""
    try:
        error = orjson.loads(body)["error"]
        shaped = isinstance(error, dict) and {"message", "type"} <= set(error)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        shaped = False
    if not shaped:
        return Outcome("failed", f"{what}: {status} without an OpenAI error body: {body[:120]!r}")
    if status == 503:
        retry_after = headers.get("retry-after", "")
        if not retry_after.isdigit():
            return Outcome("failed", f"{what}: 503 without a Retry-After in seconds")
        return Outcome("overloaded", retry_after_s=min(float(retry_after), 5.0))
    if 400 <= status < 500:
        return Outcome("refused")
    return Outcome("failed", f"{what}: {status} {body[:160]!r}")


async def one_greedy(
    client: httpx.AsyncClient, config: SoakConfig, reference: dict[str, str], rng: random.Random
) -> Outcome:
    prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
    body = chat_body(config, prompt, temperature=0, stream=stream)
    async with client.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            return refusal(r.status_code, r.headers, await r.aread(), "greedy")
        if stream:
            events = sse_events([line async for line in r.aiter_lines()])
            text = "".join(
                e["choices"][0]["delta"].get("content") or ""
                for e in events
                if isinstance(e, dict) and e.get("choices")
            )
            whole = events[-1:] == ["[DONE]"] and not any(isinstance(e, dict) and "error" in e for e in events)
        else:
            text, whole = orjson.loads(await r.aread())["choices"][0]["message"]["content"], True
    if whole and text == reference[prompt]:
        return Outcome("greedy")
    return Outcome(
        "failed",
        f"greedy {'stream' if stream else 'answer'} for {prompt!r}: {text!r} != reference "
        f"{reference[prompt]!r}{'' if whole else ' (cut short)'}",
    )


async def one_other(kind: str, client: httpx.AsyncClient, config: SoakConfig, rng: random.Random) -> Outcome:
    if kind == "invalid":
        endpoint, payload = rng.choice(INVALID)
        kwargs: dict[str, Any] = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        r = await client.post("/chat/completions" if endpoint == "chat" else "/completions", **kwargs)
        if r.status_code == 200:
            return Outcome("failed", f"invalid {payload!r:.80} was served")
        return refusal(r.status_code, r.headers, r.content, f"invalid {payload!r:.60}")
    if kind == "sampled":
        n = rng.choice((1, 2))
        r = await client.post(
            "/chat/completions",
            json=chat_body(config, rng.choice(PROMPTS), temperature=0.9, seed=rng.randrange(1 << 30), n=n),
        )
        if r.status_code != 200:
            return refusal(r.status_code, r.headers, r.content, "sampled")
        choices = r.json()["choices"]
        if len(choices) == n and all(c["finish_reason"] == "length" for c in choices):
            return Outcome("ok")
        return Outcome("failed", f"sampled answer incomplete: {r.text[:160]}")
    # disconnect: read the first piece of text, then drop the connection
    body = chat_body(config, rng.choice(PROMPTS), stream=True, max_tokens=max(64, 8 * config.max_tokens))
    async with client.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            return refusal(r.status_code, r.headers, await r.aread(), "disconnecting")
        async for line in r.aiter_lines():
            if '"content":"' in line and '"role"' not in line:
                break
    return Outcome("disconnected")


async def client_loop(
    index: int, client: httpx.AsyncClient, config: SoakConfig, reference: dict[str, str], until: float, tally: Tally
) -> None:
    rng = random.Random(config.seed * 1_000_003 + index)
    kinds = [k for k, w in WEIGHTS.items() for _ in range(w)]
    while time.monotonic() < until:
        kind = rng.choice(kinds)
        try:
            if kind == "greedy":
                outcome = await one_greedy(client, config, reference, rng)
            else:
                outcome = await one_other(kind, client, config, rng)
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            outcome = Outcome("failed", f"{kind}: {type(e).__name__}: {e}")
        if outcome.problem is not None:
            tally.fail(outcome.problem)
        else:
            tally.counts[outcome.kind] += 1
        # As the OpenAI SDK does: wait what Retry-After says (and no longer than the run).
        await asyncio.sleep(min(outcome.retry_after_s, max(0.0, until - time.monotonic())))


# ---- the server's state ------------------------------------------------------------------------------------
def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


async def read_rss(client: httpx.AsyncClient, root: str, pid: int | None) -> tuple[int | None, str]:
    """The server's resident memory: /metrics, else psutil or /proc for a process we know."""
    try:
        value = metric((await client.get(f"{root}/metrics")).text, "process_resident_memory_bytes")
    except httpx.HTTPError:
        value = None
    if value is not None:
        return int(value), "/metrics"
    if pid is None:
        return None, "unavailable (no process_resident_memory_bytes in /metrics, no --spawn)"
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss, "psutil"
    except ImportError:
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return kib * 1024, f"/proc/{pid}/status"


async def settle(
    client: httpx.AsyncClient, root: str, limit_s: float
) -> tuple[float | None, float | None, float | None, float]:
    """(running, waiting, KV pages held, seconds waited) once all are 0, or as they are after `limit_s`."""
    start = time.monotonic()
    while True:
        text = (await client.get(f"{root}/metrics")).text
        running, waiting, usage, pages = (
            metric(text, f"fp4serve_{n}")
            for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "kv_cache_pages_total")
        )
        held = None if usage is None or pages is None else round(usage * pages)
        elapsed = time.monotonic() - start
        if running is None or not (running or waiting or held) or elapsed > limit_s:
            return running, waiting, held, elapsed
        await asyncio.sleep(0.1)


async def run_soak(config: SoakConfig, pid: int | None = None) -> tuple[Tally, EndState]:
    root = config.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"),
        headers=headers,
        limits=limits,
        timeout=config.request_timeout_s,
        trust_env=False,
    ) as client:
        reference = {}
        for prompt in PROMPTS:  # alone, before any load
            r = await client.post("/chat/completions", json=chat_body(config, prompt, temperature=0))
            if r.status_code != 200:
                raise EndpointError(f"reference request failed: {r.status_code} {r.text[:200]}")
            reference[prompt] = r.json()["choices"][0]["message"]["content"]
        tally = Tally()
        start = time.monotonic()
        until = start + config.duration_s
        clients = asyncio.gather(
            *(client_loop(i, client, config, reference, until, tally) for i in range(config.concurrency))
        )
        # Warm: once the server has seen every kind of traffic; what grows after that is a leak.
        await asyncio.sleep(min(max(2.0, config.duration_s / 4), config.duration_s))
        rss_warm, _ = await read_rss(client, root, pid)
        await clients
        running, waiting, held, settled = await settle(client, root, config.settle_s)
        rss_end, source = await read_rss(client, root, pid)
    return tally, EndState(running, waiting, held, settled, rss_warm, rss_end, source)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        default=None,
        help="the endpoint, e.g. http://127.0.0.1:8000/v1 (or --spawn); "
        "greedy answers must not depend on the batch (fp4serve's are not, in float32)",
    )
    p.add_argument(
        "--spawn",
        action="store_true",
        help=f"start the embedded demo server on a free port ({' '.join(SPAWN_ARGS)}), stop it after",
    )
    p.add_argument("--server-args", default="", help="more `fp4serve serve` flags for --spawn, one string")
    p.add_argument("--model", help="default: the first of GET /models")
    p.add_argument("--api-key")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=12, help="clients sending back to back (default: %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=8, help="tokens per greedy or sampled answer (default: %(default)s)"
    )
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=64.0,
        help="largest growth of the server's resident memory from warm-up to the end (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    add_abuse_arguments(p)


def cmd_soak(args: argparse.Namespace) -> int:
    if (args.base_url is None) == (not args.spawn):
        print("error: give --base-url or --spawn (one of them)", file=sys.stderr)
        return 2
    if args.abuse:
        return cmd_abuse_soak(args)
    server = None
    try:
        if args.spawn:
            server = SpawnedServer(shlex.split(args.server_args))
        base_url = server.base_url if server else args.base_url
        config = SoakConfig(
            base_url=base_url,
            model=args.model or discover_model(base_url, args.api_key),
            duration_s=args.duration,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            seed=args.seed,
            max_rss_growth_mib=args.max_rss_growth_mib,
            api_key=args.api_key,
        )
        tally, end = asyncio.run(run_soak(config, server.process.pid if server else None))
    except (EndpointError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        exit_code = server.stop() if server else None
    if server is not None:
        end = EndState(**{**end.__dict__, "exit_code": exit_code})
    report = SoakReport(config, tally, end, f"spawned, pid {server.process.pid}" if server else "external")
    print(format_report(report))
    if server is not None and report.failures():
        print(f"server log (tail):\n{server.log_tail()}", file=sys.stderr)
    if server is not None:
        server.log_path.unlink(missing_ok=True)
    return 1 if report.failures() else 0
