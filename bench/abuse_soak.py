"""`python -m bench soak --abuse`: well-behaved streaming clients beside abusive ones (bench/abuse.py:
huge enums, deep schemas, oversized bodies over HTTP/1.1 and HTTP/2, smuggling, slowloris bodies,
bursts past the rate limits) for a few minutes. Reports the well-behaved clients' TTFT (p50, p99)
and failures, what each abuse got, and the engine's resident memory over time (a PNG and a JSON
beside it). Fails when a well-behaved request fails, an abuse gets what it must not (a smuggled
request runs, a 5xx), the grammar cache passes its budget, or requests stay in flight afterwards."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.abuse import ABUSES, Target
from bench.spawned import SpawnedServer
from bench.stats import percentile

# The abusers' key is limited; the well-behaved key is not (`--spawn` writes this keys file).
KEYS_TOML = """
[[keys]]
name = "user"
key = "{user}"

[[keys]]
name = "abuser"
key = "{abuser}"
max_concurrent = 6
rpm = 600
tpm = 200000

[[keys]]
name = "admin"
key = "{admin}"
admin = true
"""
MIB = 1 << 20
SPAWN_ARGS = (
    "--model",
    "fp4serve-demo-qwen3",
    "--max-model-len",
    "1024",
    "--kv-cache-memory",
    "128MiB",
    "--max-num-seqs",
    "16",
    "--body-timeout",
    "10",
    "--grammar-cache-bytes",
    "64MiB",
    "--max-request-bytes",
    str(4 * MIB),
)


@dataclass(frozen=True)
class AbuseSoakConfig:
    root_url: str  # http://host:port
    model: str
    user_key: str
    abuser_key: str
    duration_s: float = 180.0
    streams: int = 4  # well-behaved streaming clients, back to back
    abusers: int = 6
    max_tokens: int = 32
    sample_every_s: float = 1.0
    engine_pid: int | None = None  # for the engine's resident memory (/proc); None: not sampled
    settle_s: float = 30.0


@dataclass
class AbuseSoakResult:
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (seconds since the start, TTFT s)
    user_failures: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)  # abuse label -> count
    samples: list[dict[str, float]] = field(default_factory=list)
    in_flight_after: float | None = None
    settled_s: float = 0.0

    def failures(self) -> list[str]:
        out = [f"well-behaved: {f}" for f in self.user_failures[:20]]
        out += [f"{label} (x{n})" for label, n in self.outcomes.items() if label.startswith("FAIL")]
        over = [s for s in self.samples if s.get("grammar_cache_mib", 0.0) > s.get("grammar_budget_mib", float("inf"))]
        if over:
            out.append(f"grammar cache {max(s['grammar_cache_mib'] for s in over):.1f} MiB, over its budget")
        if self.in_flight_after:
            out.append(f"{self.in_flight_after:g} requests still in flight {self.settled_s:.0f} s after the traffic")
        if not self.ttfts:
            out.append("no well-behaved request finished")
        return out


def _engine_rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


async def _user_loop(
    client: httpx.AsyncClient, config: AbuseSoakConfig, start: float, until: float, result: AbuseSoakResult
) -> None:
    body = {
        "model": config.model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": config.max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    while time.monotonic() < until:
        sent = time.monotonic()
        first: float | None = None
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {config.user_key}"}
            ) as r:
                if r.status_code != 200:
                    result.user_failures.append(f"{r.status_code} {(await r.aread())[:120]!r}")
                    continue
                done = False
                async for line in r.aiter_lines():
                    if first is None and '"content":"' in line and '"role"' not in line:
                        first = time.monotonic()
                    if '"error"' in line:
                        result.user_failures.append(f"error event {line[:120]}")
                    done = done or line == "data: [DONE]"
            if first is None or not done:
                result.user_failures.append("a stream ended without text or [DONE]")
            else:
                result.ttfts.append((sent - start, first - sent))
        except httpx.HTTPError as e:
            result.user_failures.append(f"{type(e).__name__}: {e}")


async def _abuser_loop(
    index: int, client: httpx.AsyncClient, target: Target, until: float, result: AbuseSoakResult
) -> None:
    rng = random.Random(index)
    kinds = [name for name, (weight, _) in ABUSES.items() for _ in range(weight)]
    rng.shuffle(kinds)  # each abuser goes through every kind, in its own order
    turn = 0
    while time.monotonic() < until:
        name, turn = kinds[turn % len(kinds)], turn + 1
        try:
            label = await ABUSES[name][1](client, target, rng)
        except (httpx.HTTPError, OSError) as e:  # a connection the server closed on a bad request
            label = f"{name} {type(e).__name__}"
        result.outcomes[label] += 1


async def _sampler(
    client: httpx.AsyncClient, config: AbuseSoakConfig, start: float, stop: asyncio.Event, result: AbuseSoakResult
) -> None:
    while not stop.is_set():
        try:
            text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            text = ""
        http_rss, cache, held, budget = (
            _metric(text, n)
            for n in (
                "process_resident_memory_bytes",
                "fp4serve_grammar_cache_bytes",
                "fp4serve_grammar_held_bytes",
                "fp4serve_grammar_cache_budget_bytes",
            )
        )
        sample = {"t": time.monotonic() - start, "in_flight": _metric(text, "fp4serve_http_requests_in_flight") or 0.0}
        for key, value in (
            ("engine_rss_mib", _engine_rss_mib(config.engine_pid)),
            ("http_rss_mib", None if http_rss is None else http_rss / MIB),
            ("grammar_cache_mib", None if cache is None else cache / MIB),
            ("grammar_held_mib", None if held is None else held / MIB),
            ("grammar_budget_mib", None if budget is None else budget / MIB),
        ):
            if value is not None:
                sample[key] = value
        result.samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), config.sample_every_s)
        except TimeoutError:
            pass


async def run_abuse_soak(config: AbuseSoakConfig) -> AbuseSoakResult:
    host, port = config.root_url.removeprefix("http://").rsplit(":", 1)
    target = Target(host.strip("[]"), int(port), config.model, config.abuser_key, config.user_key)
    result = AbuseSoakResult()
    limits = httpx.Limits(max_connections=config.streams + 4 * config.abusers + 30)
    async with httpx.AsyncClient(base_url=config.root_url, timeout=180.0, limits=limits, trust_env=False) as client:
        start = time.monotonic()
        until = start + config.duration_s
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sampler(client, config, start, stop, result))
        await asyncio.gather(
            *(_user_loop(client, config, start, until, result) for _ in range(config.streams)),
            *(_abuser_loop(i, client, target, until, result) for i in range(config.abusers)),
        )
        settle_start = time.monotonic()
        while time.monotonic() - settle_start < config.settle_s:
            result.in_flight_after = _metric((await client.get("/metrics")).text, "fp4serve_http_requests_in_flight")
            if not result.in_flight_after:
                break
            await asyncio.sleep(0.2)
        result.settled_s = time.monotonic() - settle_start
        stop.set()
        await sampler
    return result


def format_abuse_report(config: AbuseSoakConfig, result: AbuseSoakResult, chart: Path | None) -> str:
    ttft = sorted(t for _, t in result.ttfts)
    engine = [s["engine_rss_mib"] for s in result.samples if "engine_rss_mib" in s]
    cache = [s.get("grammar_cache_mib", 0.0) for s in result.samples]
    budget = next((s["grammar_budget_mib"] for s in result.samples if s.get("grammar_budget_mib")), None)
    lines = [
        f"soak --abuse: {config.duration_s:g} s, {config.streams} well-behaved streams, {config.abusers} abusers, "
        f"{config.root_url}, {config.model}",
        f"well-behaved  {len(ttft)} streams, {len(result.user_failures)} failed; TTFT p50 "
        + (
            f"{percentile(ttft, 50) * 1000:.0f} ms, p99 {percentile(ttft, 99) * 1000:.0f} ms, max {ttft[-1] * 1000:.0f} ms"  # noqa: E501
            if ttft
            else "n/a"
        ),
        "abuse         " + ", ".join(f"{label} x{n}" for label, n in sorted(result.outcomes.items())),
        "engine RSS    "
        + (
            f"{engine[0]:.0f} MiB at the start, peak {max(engine):.0f}, end {engine[-1]:.0f}"
            if engine
            else "n/a (no --engine-pid)"
        ),
        f"grammar cache peak {max(cache, default=0.0):.1f} MiB (and "
        f"{max((s.get('grammar_held_mib', 0.0) for s in result.samples), default=0.0):.1f} MiB held past it) of a "
        + (f"{budget:.0f} MiB budget" if budget else "budget not reported (no constrained request finished)"),
        f"in flight     {result.in_flight_after or 0:g} after {result.settled_s:.1f} s",
    ]
    if chart is not None:
        lines.append(f"chart         {chart}")
    failures = result.failures()
    lines += [f"  FAIL {f}" for f in failures[:15]]
    lines.append("FAIL" if failures else "PASS")
    return "\n".join(lines)


def write_abuse_outputs(config: AbuseSoakConfig, result: AbuseSoakResult, out_dir: Path) -> Path:
    """The JSON of the run and its chart; returns the chart's path."""
    from bench.plot import plot_soak_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "config": config.__dict__ | {"user_key": "***", "abuser_key": "***"},
        "ttfts": result.ttfts,
        "outcomes": dict(result.outcomes),
        "samples": result.samples,
        "user_failures": result.user_failures,
        "failures": result.failures(),
    }
    (out_dir / "soak_abuse.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return plot_soak_timeline(
        result.samples,
        result.ttfts,
        out_dir / "soak_abuse.png",
        f"fp4serve under abuse: {config.streams} well-behaved streams, {config.abusers} abusers",
    )


# ---- the command -------------------------------------------------------------------------------------
def add_abuse_arguments(p: Any) -> None:
    g = p.add_argument_group("--abuse", "well-behaved streams beside abusive clients (issue 32's probe)")
    g.add_argument(
        "--abuse",
        action="store_true",
        help="run the abuse soak instead of the mixed-traffic one; with "
        f"--spawn the server gets three keys (user, abuser with limits, admin) and {' '.join(SPAWN_ARGS)}",
    )
    g.add_argument("--streams", type=int, default=4, help="well-behaved streaming clients (default: %(default)s)")
    g.add_argument("--abusers", type=int, default=6, help="abusive clients (default: %(default)s)")
    g.add_argument("--user-key", help="the well-behaved clients' key (external server)")
    g.add_argument("--abuser-key", help="the abusers' key, best with limits (external server)")
    g.add_argument("--engine-pid", type=int, help="the engine process, for its resident memory (external server)")
    g.add_argument("--out", default="bench-results/soak-abuse", help="where the JSON and the chart go")


def _engine_child(pid: int) -> int | None:
    """The engine process among a spawned server's children (multiprocessing's spawn_main)."""
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                return int(child)
    return None


def cmd_abuse_soak(args: Any) -> int:
    import secrets
    import shlex
    import sys
    import tempfile

    from bench.serve import EndpointError, discover_model

    server = None
    keys = {name: f"sk-{name}-{secrets.token_hex(8)}" for name in ("user", "abuser", "admin")}
    try:
        if args.spawn:
            keys_file = Path(tempfile.mkdtemp(prefix="fp4serve-abuse-")) / "keys.toml"
            keys_file.write_text(KEYS_TOML.format(**keys))
            server = SpawnedServer(
                ["--api-keys-file", str(keys_file), *shlex.split(args.server_args)], base_args=SPAWN_ARGS, name="abuse"
            )
            root, engine_pid = server.base_url.removesuffix("/v1"), _engine_child(server.process.pid)
        else:
            if args.base_url is None or not (args.user_key and args.abuser_key):
                print("error: --abuse needs --spawn, or --base-url with --user-key and --abuser-key", file=sys.stderr)
                return 2
            keys.update(user=args.user_key, abuser=args.abuser_key)
            root, engine_pid = args.base_url.rstrip("/").removesuffix("/v1"), args.engine_pid
        config = AbuseSoakConfig(
            root_url=root,
            model=args.model or discover_model(f"{root}/v1", keys["user"]),
            user_key=keys["user"],
            abuser_key=keys["abuser"],
            duration_s=args.duration,
            streams=args.streams,
            abusers=args.abusers,
            engine_pid=engine_pid,
        )
        result = asyncio.run(run_abuse_soak(config))
    except (EndpointError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        exit_code = server.stop() if server else None
    chart = write_abuse_outputs(config, result, Path(args.out))
    print(format_abuse_report(config, result, chart))
    if server is not None:
        print(f"server        exited {exit_code} after SIGTERM")
        if exit_code != 0 or result.failures():
            print(f"server log (tail):\n{server.log_tail()}", file=sys.stderr)
        server.log_path.unlink(missing_ok=True)
    return 1 if result.failures() or exit_code not in (None, 0) else 0
