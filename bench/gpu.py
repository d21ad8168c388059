"""The GPU benchmark: one model shape with random weights (bench/random_checkpoint.py writes the
checkpoint, the engine's own loader reads it: bf16, or NVFP4 quantized at load), measured three ways:

* decode step time at batch 1, 16, 64, 256 with 1k tokens of context, eager and, where the engine
  captures decode CUDA graphs for the model, with them, against the HBM floor: the bytes a step
  must move (bench/step_floor.py) over the copy bandwidth measured in this run. The timed region is
  one `ModelRunner.execute` of a pure-decode batch, as the engine core runs it: batch tensors,
  attention plan, forward (graph replay or eager), logits, sampling (greedy) and the read-back of
  the sampled tokens; not the scheduler, detokenization or output processing.
* engine output tokens/s for random 1000-in / 1000-out requests, all 64 in flight (OfflineEngine);
* the same workload through transformers' `generate` (static batch, its own cache) as the peer.

    python -m bench.gpu [--shape qwen3-8b] [--layers 4] [--formats bf16 nvfp4] [--out gpu.json]
    python -m bench.gpu --device cpu --tiny ...   # the same code on CPU, in seconds: a rehearsal

engine/ and kernels/ are imported inside functions (bench/ layering rule)."""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu_steps import BLOCK_SIZE, WARMUP_STEPS, StepRow, bench_decode_steps, sync
from bench.random_checkpoint import SHAPES, write_random_checkpoint


@dataclass(frozen=True)
class ThroughputRow:
    system: str
    format: str
    num_requests: int
    input_len: int
    output_len: int
    duration_s: float
    output_tokens_per_s: float
    note: str
    phase_s: dict[str, float] = field(default_factory=dict)  # fp4serve: OfflineEngine's cumulative step phases


class Progress:
    """One line per phase on stderr, with the seconds since the run started: the device run's log."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[bench.gpu {time.perf_counter() - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---- the device-only calls ------------------------------------------------------------------------
def release(device: torch.device) -> None:
    """Give back what a finished phase held (an engine's KV pages, CUDA graph pools)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_gbps(device: torch.device, reps: int = 20) -> float:
    """Bytes read plus bytes written per second by a large copy on the device."""
    if device.type == "cuda":
        from bench.kernels import copy_bandwidth_gbps

        return copy_bandwidth_gbps(reps=reps)
    src = torch.ones(64 << 20, dtype=torch.uint8)  # [64 MiB] uint8, cpu: far beyond the caches
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times) / 1e9


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"


# ---- the engine -------------------------------------------------------------------------------------
def engine_config(folder: Path, fmt: str, args: argparse.Namespace) -> Any:
    """One engine for both measurements: room for the largest decode batch and for every request in
    flight at once, KV pages for both (and no more), decode graphs captured by the benchmark."""
    from engine.config import EngineConfig
    from engine.model_runner import kv_bytes_per_token
    from engine.weights.config.model_config import ModelConfig

    max_num_seqs = max(max(args.batch_sizes), args.num_requests)
    max_model_len = max(args.context + 1, args.input_len + args.output_len) + BLOCK_SIZE
    decode_tokens = max(args.batch_sizes) * math.ceil((args.context + 1) / BLOCK_SIZE) * BLOCK_SIZE
    tokens = max(decode_tokens, args.num_requests * max_model_len)
    per_token = kv_bytes_per_token(ModelConfig.from_checkpoint(folder), torch.bfloat16)
    return EngineConfig(
        model=str(folder),
        dtype="bfloat16",
        quantization="nvfp4" if fmt == "nvfp4" else "none",
        device=args.device,
        max_num_seqs=max_num_seqs,
        num_state_slots=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        kv_cache_memory=str(int(tokens * per_token * 1.05) + BLOCK_SIZE * per_token),
        enforce_eager=True,
    )  # the eager steps are timed first; bench_decode_steps captures


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


def bench_engine(
    engine: Any, fmt: str, num_requests: int, input_len: int, output_len: int, graphs_note: str
) -> ThroughputRow:
    """OfflineEngine.generate of every request at once. First, untimed, a quarter of them (other
    prompts) for 4 tokens: the prefill steps reach the timed run's token counts, so kernels that
    compile or tune per shape (Triton, fla-core) do it outside the timing."""
    from engine.front.offline import PhaseTimings
    from scheduler.request import SamplingParams

    vocab = engine.info.vocab_size
    engine.generate(
        random_prompts(max(1, num_requests // 4), input_len, vocab, seed=1),
        SamplingParams(max_tokens=4, temperature=0.0),
    )
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)
    prompts = random_prompts(num_requests, input_len, vocab, seed=0)
    engine.timings = PhaseTimings()  # the warm-up's phases out
    device = engine.core.runner.device
    sync(device)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    duration = time.perf_counter() - start
    produced = sum(len(r.token_ids[0]) for r in results)
    phases = {k: round(v, 3) for k, v in engine.timings.as_dict().items()}
    note = f"attention {engine.info.attention_backend}; graphs {graphs_note}"
    return ThroughputRow(
        "fp4serve",
        fmt,
        num_requests,
        input_len,
        output_len,
        round(duration, 2),
        round(produced / duration, 1),
        note,
        phases,
    )


# ---- the peer ---------------------------------------------------------------------------------------
@torch.inference_mode()
def bench_transformers(
    folder: Path, device: torch.device, num_requests: int, input_len: int, output_len: int
) -> ThroughputRow:
    """transformers' generate on the same checkpoint: one static batch, greedy, no early stop."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    cfg = model.config
    note = f"generate, one static batch; attention {cfg._attn_implementation}"
    if getattr(cfg, "num_experts", None):
        note += f"; experts {getattr(cfg, '_experts_implementation', None)}"
    if "Qwen3_5" in type(model).__name__:  # transformers takes these packages' kernels where they import
        found = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
        note += (
            f"; DeltaNet {'fla-core' if found['fla'] else 'torch (no fla-core)'}, "
            f"conv {'causal-conv1d' if found['causal_conv1d'] else 'torch'}"
        )
    vocab = model.config.vocab_size
    prompts = torch.tensor(random_prompts(num_requests, input_len, vocab, seed=0), device=device)  # [R, in] int64
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
    warm = torch.tensor(random_prompts(max(1, num_requests // 4), input_len, vocab, seed=1), device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, **kwargs)  # as bench_engine's
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len, min_new_tokens=output_len, **kwargs
    )
    sync(device)
    duration = time.perf_counter() - start
    produced = (out.shape[1] - input_len) * num_requests
    return ThroughputRow(
        "transformers",
        "bf16",
        num_requests,
        input_len,
        output_len,
        round(duration, 2),
        round(produced / duration, 1),
        note,
    )


# ---- report -----------------------------------------------------------------------------------------
def print_report(title: str, gbps: float, steps: list[StepRow], throughput: list[ThroughputRow]) -> None:
    mib = 1 << 20
    print(f"{title}; copy bandwidth {gbps:.0f} GB/s (read + write)")
    print(
        f"{'format':7} {'batch':>5} {'ctx':>5} | {'eager ms':>9} {'graph ms':>9} | {'floor ms':>9} "
        f"{'floor/step':>10} | {'weights':>8} {'experts':>8} {'KV':>8} {'state':>8} MiB"
    )
    for r in steps:
        graph = "-" if r.graph_ms is None else f"{r.graph_ms:9.2f}"
        print(
            f"{r.format:7} {r.batch_size:5d} {r.context:5d} | {r.eager_ms:9.2f} {graph:>9} | {r.floor_ms:9.2f} "
            f"{100 * r.fraction_of_floor:9.0f}% | {r.weight_bytes / mib:8.1f} {r.expert_bytes / mib:8.1f} "
            f"{r.kv_bytes / mib:8.1f} {r.state_bytes / mib:8.1f}"
        )
    for t in throughput:
        print(
            f"{t.system:12} {t.format:6} {t.num_requests} x {t.input_len}in/{t.output_len}out: "
            f"{t.output_tokens_per_s:8.1f} output tok/s ({t.duration_s:.1f} s; {t.note})"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="whose config.json shapes the model has")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the model's own count); "
        "fewer for a quick run (a hybrid needs 4 for one attention layer)",
    )
    p.add_argument("--tiny", action="store_true", help="the same architecture at a few MB (bench.random_checkpoint)")
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the same code path without FlashInfer, graphs or NVFP4 kernels (use with --tiny)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=["bf16", "nvfp4"],
        choices=["bf16", "nvfp4"],
        help="bf16 weights, or NVFP4 linears quantized at load (the lm_head stays bf16)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256], help="decode batch sizes timed")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each decoding sequence's KV")
    p.add_argument("--reps", type=int, default=20, help=f"timed decode steps per point (after {WARMUP_STEPS} untimed)")
    p.add_argument("--num-requests", type=int, default=64, help="engine/transformers: requests, all in flight")
    p.add_argument("--input-len", type=int, default=1000, help="engine/transformers: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1000, help="engine/transformers: generated tokens per request")
    p.add_argument("--skip-engine", action="store_true", help="no engine tok/s (decode steps only)")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers peer")
    p.add_argument("--out", help="write the rows as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA GPU here; rehearse with --device cpu --tiny", file=sys.stderr)
        return 2
    from engine.front.offline import OfflineEngine

    progress = Progress()
    device = torch.device(args.device)
    tiny = " (tiny)" if args.tiny else ""
    progress(f"{args.shape}, {args.layers or 'all'} layers{tiny}, on {device_name(device)}; measuring copy bandwidth")
    gbps = copy_gbps(device)
    steps: list[StepRow] = []
    throughput: list[ThroughputRow] = []
    report: dict[str, Any] = {
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "layers": args.layers,
        "tiny": args.tiny,
        "formats": args.formats,
        "context": args.context,
        "copy_gbps": round(gbps, 1),
        "load_s": {},
    }

    def save(complete: bool) -> None:
        """After every phase: a run cut short by its time limit keeps what it measured."""
        if args.out:
            rows = {"steps": [asdict(r) for r in steps], "throughput": [asdict(t) for t in throughput]}
            Path(args.out).write_text(json.dumps({**report, **rows, "complete": complete}, indent=1))

    with tempfile.TemporaryDirectory(prefix="fp4serve-bench-gpu-") as tmp:
        progress("writing the random checkpoint")
        folder = write_random_checkpoint(args.shape, Path(tmp), layers=args.layers, tiny=args.tiny, device=device)
        report["layers"] = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        for fmt in args.formats:
            progress(f"{fmt}: loading the engine")
            start = time.perf_counter()
            engine = OfflineEngine.from_config(engine_config(folder, fmt, args))
            report["load_s"][fmt] = round(time.perf_counter() - start, 1)
            rows, graphs_note = bench_decode_steps(
                engine.core.runner, fmt, args.batch_sizes, args.context, gbps, args.reps, progress
            )
            steps += rows
            save(False)
            if not args.skip_engine:
                progress(f"{fmt}: engine, {args.num_requests} x {args.input_len} in / {args.output_len} out")
                throughput.append(
                    bench_engine(engine, fmt, args.num_requests, args.input_len, args.output_len, graphs_note)
                )
                progress(f"{fmt}: engine: {throughput[-1].output_tokens_per_s} output tok/s")
                save(False)
            engine.core.close()
            del engine
            release(device)
        if not args.skip_transformers:
            progress(f"transformers: {args.num_requests} x {args.input_len} in / {args.output_len} out")
            throughput.append(bench_transformers(folder, device, args.num_requests, args.input_len, args.output_len))
            progress(f"transformers: {throughput[-1].output_tokens_per_s} output tok/s")
            release(device)
    progress("done")
    save(True)
    print_report(
        f"{args.shape}, {report['layers']} layers{tiny}, {report['device']}, torch {torch.__version__}",
        gbps,
        steps,
        throughput,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
