"""The served smoke test of a GPU run: `fp4serve serve` on a random-weight checkpoint with a real
model's shapes (bench.random_checkpoint, written on the device), quantized to NVFP4 at load, driven
as its users drive it, through the OpenAI SDK:

* `--streams` concurrent streaming chat completions all finish, each with every token it was
  charged for, and each arrives token by token (as many content chunks as tokens, give or take
  the few the detokenizer holds back for an unfinished UTF-8 character, spread over the stream's
  life rather than in one burst at the end);
* greedy output equals the torch attention backend's (a second server on the same checkpoint,
  started beside the first) for `--greedy-tokens` tokens, on several prompts. Where they part,
  the verdict is a tie only if the two best logprobs at that token were within `--tie-margin`:
  bf16 attention kernels sum in different orders, and a random model has near-ties.

    python -m bench.gpu_smoke --out smoke.json                      # on the GPU server
    python -m bench.gpu_smoke --device cpu --tiny --streams 8       # the CPU rehearsal

Exit status 0 only if every check passed. bench/ drives the server over HTTP only."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.random_checkpoint import SHAPES, write_random_checkpoint
from bench.spawned import SpawnedServer

PROMPTS = (
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What is the capital of France?",
    "Explain paged attention in one sentence.",
)


@dataclass
class StreamResult:
    completion_tokens: int = 0
    content_chunks: int = 0
    finish_reason: str | None = None
    ttft_s: float = 0.0
    duration_s: float = 0.0
    # Share of the time from its first content chunk to its last that passed before half of its
    # chunks had arrived: ~0.5 for a steady token-by-token stream, ~1.0 for one burst at the end.
    # (Measured from the first chunk: the wait for the first token is the prefill's, not streaming.)
    half_chunks_at: float = 0.0
    most_chunks_in_1ms: int = 0  # the largest number of content chunks that arrived within 1 ms
    error: str | None = None


@dataclass
class GreedyResult:
    prompt: str
    tokens: int
    equal_tokens: int  # leading tokens both backends chose alike
    verdict: str  # "equal" | "tie" (parted at a near-tie) | "differ"
    margin_at_split: float | None = None


@dataclass
class SmokeReport:
    shape: str
    layers: int
    device: str
    backend: str  # the attention backend /health names for the server under test
    reference_backend: str
    startup_s: float
    streams: list[StreamResult] = field(default_factory=list)
    greedy: list[GreedyResult] = field(default_factory=list)
    output_tokens_per_s: float = 0.0
    failures: list[str] = field(default_factory=list)


# ---- the servers ------------------------------------------------------------------------------------
def server_args(model: Path, device: str, backend: str, streams: int) -> list[str]:
    return [
        "--model",
        str(model),
        "--device",
        device,
        "--dtype",
        "bfloat16",
        "--quantization",
        "nvfp4",
        "--attention-backend",
        backend,
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "4GiB",
        "--max-num-seqs",
        str(streams),
        "--max-logprobs",
        "5",
    ]


def start_pair(model: Path, device: str, streams: int) -> tuple[SpawnedServer, SpawnedServer, float]:
    """The server under test (attention auto: FlashInfer on a GPU) and the torch-attention reference,
    started side by side so their loads overlap; the seconds until both answered."""
    started = time.monotonic()
    servers: dict[str, SpawnedServer | BaseException] = {}

    def start(name: str, backend: str) -> None:
        try:
            servers[name] = SpawnedServer(
                server_args(model, device, backend, streams), start_timeout_s=600.0, base_args=(), name=f"smoke-{name}"
            )
        except BaseException as e:  # reported below, with the other server stopped
            servers[name] = e

    threads = [threading.Thread(target=start, args=a) for a in (("test", "auto"), ("ref", "torch"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [s for s in servers.values() if isinstance(s, BaseException)]
    if failed:
        for s in servers.values():
            if isinstance(s, SpawnedServer):
                s.stop()
        raise failed[0]
    test, ref = servers["test"], servers["ref"]
    assert isinstance(test, SpawnedServer) and isinstance(ref, SpawnedServer)
    return test, ref, time.monotonic() - started


def backend_of(server: SpawnedServer) -> str:
    body = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10, trust_env=False).json()
    return str(body.get("backend") or body.get("attention_backend") or body)


# ---- the checks -------------------------------------------------------------------------------------
async def one_stream(
    client: Any, model: str, prompt: str, max_tokens: int, clock: Callable[[], float] = time.monotonic
) -> StreamResult:
    result = StreamResult()
    arrivals: list[float] = []
    start = clock()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            temperature=1.0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    arrivals.append(clock() - start)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
    except Exception as e:  # one failed stream is a finding, not the end of the run
        result.error = f"{type(e).__name__}: {e}"
    result.duration_s = clock() - start
    result.content_chunks = len(arrivals)
    if arrivals:
        result.ttft_s = arrivals[0]
        span = arrivals[-1] - arrivals[0]
        result.half_chunks_at = (arrivals[(len(arrivals) - 1) // 2] - arrivals[0]) / span if span > 0 else 1.0
        result.most_chunks_in_1ms = max(bisect.bisect_right(arrivals, t + 1e-3) - i for i, t in enumerate(arrivals))
    return result


def check_streams(results: list[StreamResult], max_tokens: int) -> list[str]:
    failures = []
    for i, r in enumerate(results):
        if r.error:
            failures.append(f"stream {i}: {r.error}")
        elif r.finish_reason != "length" or r.completion_tokens != max_tokens:
            failures.append(f"stream {i}: finish {r.finish_reason}, {r.completion_tokens}/{max_tokens} tokens")
        elif r.content_chunks < 0.8 * r.completion_tokens:
            failures.append(f"stream {i}: {r.content_chunks} content chunks for {r.completion_tokens} tokens")
        elif r.half_chunks_at > 0.95 or r.most_chunks_in_1ms > max(2, r.content_chunks // 4):
            failures.append(
                f"stream {i}: its chunks came in a burst (half of them by {r.half_chunks_at:.2f} of "
                f"its streaming time, {r.most_chunks_in_1ms} within 1 ms)"
            )
    return failures


async def run_streams(base_url: str, model: str, streams: int, max_tokens: int) -> tuple[list[StreamResult], float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        start = time.monotonic()
        results = await asyncio.gather(
            *(one_stream(client, model, PROMPTS[i % len(PROMPTS)] + f" ({i})", max_tokens) for i in range(streams))
        )
        wall = time.monotonic() - start
    return list(results), sum(r.completion_tokens for r in results) / wall


def greedy_tokens(base_url: str, model: str, prompt: str, tokens: int) -> list[tuple[str, list[float]]]:
    """The greedy tokens and, for each, the two best logprobs."""
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
    content = out.choices[0].logprobs.content or []
    return [(c.token, [t.logprob for t in c.top_logprobs]) for c in content]


def compare_greedy(
    prompt: str, test: list[tuple[str, list[float]]], ref: list[tuple[str, list[float]]], tie_margin: float
) -> GreedyResult:
    same = 0
    while same < min(len(test), len(ref)) and test[same][0] == ref[same][0]:
        same += 1
    if same == len(test) == len(ref):
        return GreedyResult(prompt, len(test), same, "equal")
    if same == min(len(test), len(ref)):  # one stopped early: a length difference, never a tie
        return GreedyResult(prompt, len(test), same, "differ")
    # A near-tie in both runs: each backend's own top two within the margin (one backend sure of
    # its choice while the other wavers is a real difference).
    margins = [lp[0] - lp[1] for lp in (test[same][1], ref[same][1]) if len(lp) >= 2]
    margin = max(margins) if len(margins) == 2 else None
    verdict = "tie" if margin is not None and margin <= tie_margin else "differ"
    return GreedyResult(prompt, len(test), same, verdict, None if margin is None else round(margin, 4))


# ---- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace, folder: Path) -> SmokeReport:
    model_dir = Path(args.checkpoint) if args.checkpoint else folder / "model"
    if not args.checkpoint:
        t = time.monotonic()
        write_random_checkpoint(args.shape, model_dir, layers=args.layers, tiny=args.tiny, device=args.device)
        print(f"[smoke] checkpoint written in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    test, ref, startup = start_pair(model_dir, args.device, args.streams)
    print(f"[smoke] both servers ready in {startup:.1f} s", file=sys.stderr, flush=True)
    try:
        report = SmokeReport(args.shape, layers, args.device, backend_of(test), backend_of(ref), round(startup, 1))
        name = model_dir.name
        report.streams, report.output_tokens_per_s = asyncio.run(
            run_streams(test.base_url, name, args.streams, args.max_tokens)
        )
        report.failures += check_streams(report.streams, args.max_tokens)
        print(f"[smoke] {args.streams} streams done", file=sys.stderr, flush=True)
        for prompt in PROMPTS:
            result = compare_greedy(
                prompt,
                greedy_tokens(test.base_url, name, prompt, args.greedy_tokens),
                greedy_tokens(ref.base_url, name, prompt, args.greedy_tokens),
                args.tie_margin,
            )
            report.greedy.append(result)
            if result.verdict == "differ":
                report.failures.append(
                    f"greedy '{prompt}': parted from the torch backend at token "
                    f"{result.equal_tokens} (margin {result.margin_at_split})"
                )
        if args.device == "cuda" and "flashinfer" not in report.backend:
            report.failures.append(f"the server under test runs '{report.backend}', not FlashInfer")
    finally:
        for server, tag in ((test, "test"), (ref, "ref")):
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                (Path(args.logs) / f"smoke-server-{tag}.log").write_text(server.log_tail(200_000))
            server.stop()
    return report


def print_report(r: SmokeReport) -> None:
    ok = [s for s in r.streams if not s.error]
    print(
        f"served smoke test: {r.shape}, {r.layers} layers, NVFP4 at load, {r.device}; "
        f"backend {r.backend!r} against {r.reference_backend!r}; both ready in {r.startup_s} s"
    )
    if ok:
        print(
            f"  {len(r.streams)} streams: {sum(s.completion_tokens for s in ok)} tokens, "
            f"{r.output_tokens_per_s:.1f} output tok/s; TTFT median {statistics.median(s.ttft_s for s in ok):.3f} s; "
            f"content chunks per token min {min(s.content_chunks / max(s.completion_tokens, 1) for s in ok):.2f}; "
            f"half of the chunks by {max(s.half_chunks_at for s in ok):.2f} of the streaming time and "
            f"{max(s.most_chunks_in_1ms for s in ok)} chunks within 1 ms at worst"
        )
    for g in r.greedy:
        print(
            f"  greedy {g.verdict:6} {g.equal_tokens}/{g.tokens} tokens alike"
            + ("" if g.margin_at_split is None else f", margin {g.margin_at_split} where they part")
            + f"  ({g.prompt})"
        )
    print("PASS" if not r.failures else "FAIL:\n  " + "\n  ".join(r.failures))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="whose shapes the checkpoint copies")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--tiny", action="store_true", help="the tiny variant of the shape (the CPU rehearsal)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--checkpoint", default=None, help="serve this folder instead of writing a random one")
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming requests")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens compared with the torch backend")
    p.add_argument(
        "--tie-margin",
        type=float,
        default=0.05,
        help="logprob gap under which a parting of the two backends counts as a near-tie",
    )
    p.add_argument("--logs", default=None, help="copy both servers' logs into this folder")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fp4serve-smoke-") as folder:
        report = run(args, Path(folder))
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(report), indent=1))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
