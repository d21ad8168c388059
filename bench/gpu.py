"""The GPU benchmark: on one GPU, in one run, a Qwen3-8B-shaped model with random weights built in
memory (bf16, and NVFP4 linears through kernels/) is measured three ways:

* decode step time at batch 1, 16, 64, 256 with 1k tokens of context, eager and with CUDA graphs,
  against the HBM floor: bytes of weights and KV read per step over the copy bandwidth measured in
  this run;
* engine output tokens/s for random 1000-in / 1000-out requests at concurrency 64;
* the same workload through transformers' `generate` (static batch, its own KV cache), the peer.

    python -m bench.gpu [--formats bf16 nvfp4] [--batch-sizes 1 16 64 256] [--out results.json]

CUDA only. engine/ and kernels/ are imported inside functions (bench/ layering rule)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.kernels import copy_bandwidth_gbps

# Qwen3-8B's config.json fields that shape the compute (weights are random).
QWEN3_8B: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    eos_token_id=151645, bos_token_id=None,
)
BLOCK_SIZE = 16
CUDA = torch.device("cuda")


@dataclass(frozen=True)
class StepRow:
    format: str
    batch_size: int
    context: int
    eager_ms: float
    graph_ms: float | None
    floor_ms: float
    bytes_per_step: int
    graph_fraction_of_floor: float | None  # floor / graph time: 1.0 is the memory roofline


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


# ---- the model ----------------------------------------------------------------------------------
class _ShardedNVFP4(torch.nn.Module):
    """NVFP4Linear plus the `shard_sizes` the decoder splits fused q/k/v and gate/up by."""

    def __init__(self, inner: torch.nn.Module, shard_sizes: list[int]) -> None:
        super().__init__()
        self.inner = inner
        self.shard_sizes = shard_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def build_model(raw: dict[str, Any], fmt: str, max_len: int) -> Any:
    """A DecoderForCausalLM on the GPU with random weights (std 0.02, norms 1); with fmt "nvfp4"
    every decoder linear is quantized (one layer at a time: the bf16 copy never coexists whole)."""
    from engine.config import ModelConfig
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.layers import Linear
    from kernels.nvfp4 import quantize_nvfp4
    from kernels.nvfp4_matmul import NVFP4Linear

    cfg = ModelConfig.from_dict(raw)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA):
            model = DecoderForCausalLM(cfg, max_len)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        if fmt == "nvfp4":
            for layer in model.layers:
                for parent in (layer.self_attn, layer.mlp):
                    for attr, child in list(parent.named_children()):
                        if isinstance(child, Linear):
                            nv = NVFP4Linear(quantize_nvfp4(child.weight.float()), child.bias)
                            setattr(parent, attr, _ShardedNVFP4(nv, child.shard_sizes))
    return model.eval()


def weight_bytes_per_step(model: Any) -> int:
    """Weights a decode step reads: every linear (NVFP4 codes and scales, or bf16) and the norms;
    not the embedding table, of which a step reads only its tokens' rows."""
    from kernels.nvfp4_matmul import NVFP4Linear

    total = sum(m.weight_nbytes for m in model.modules() if isinstance(m, NVFP4Linear))
    total += sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    return total


def kv_bytes_per_token(raw: dict[str, Any]) -> int:
    return 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * raw["head_dim"] * 2  # bf16 K and V


# ---- decode step time ----------------------------------------------------------------------------
def decode_batch(batch_size: int, context: int, pages_per_seq: int, vocab: int) -> Any:
    """B requests each decoding the token after `context` tokens, on disjoint pages."""
    from engine.batch import build_forward_batch
    from scheduler.output import ScheduledRequest, SchedulerOutput

    g = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, vocab, (batch_size,), generator=g).tolist()
    reqs = tuple(ScheduledRequest(f"r{i}", (tokens[i],), context, tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                                  True) for i in range(batch_size))
    return build_forward_batch(SchedulerOutput(reqs, ()), BLOCK_SIZE, CUDA)


def time_steps(model: Any, runner: Any, batch_size: int, context: int, pages_per_seq: int, reps: int) -> float:
    """Median ms of one decode step as the engine runs it: batch tensors, plan, forward (graph or
    eager), logits, greedy pick, read-back."""
    vocab = model.config.vocab_size
    times = []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        batch = decode_batch(batch_size, context, pages_per_seq, vocab)
        hidden = runner.forward(batch)
        model.compute_logits(hidden[batch.logits_indices]).argmax(-1).tolist()
        if i >= 3:  # the first steps warm up allocators and kernel selection
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def bench_decode_steps(model: Any, raw: dict[str, Any], fmt: str, batch_sizes: list[int], context: int,
                       copy_gbps: float, reps: int) -> list[StepRow]:
    from engine.attention.backend import kv_cache_shape
    from engine.attention.select import choose_backend, flashinfer_import_error, make_backend
    from engine.cuda_graph import CudaGraphRunner, DecodeBuckets, graphs_disabled_reason

    cfg = model.config
    pages_per_seq = math.ceil((context + 1) / BLOCK_SIZE)
    num_pages = max(batch_sizes) * pages_per_seq
    caches = [torch.zeros(kv_cache_shape(num_pages + 1, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim),
                          dtype=torch.bfloat16, device=CUDA) for _ in range(cfg.num_layers)]
    name = choose_backend("auto", CUDA, flashinfer_import_error(CUDA) is None, dtype=torch.bfloat16, head_dim=cfg.head_dim)
    backend = make_backend(name, cfg, torch.bfloat16, CUDA, BLOCK_SIZE)
    runner = CudaGraphRunner(model, caches, backend, DecodeBuckets(tuple(sorted(batch_sizes))), num_pages, pages_per_seq)
    eager = {b: time_steps(model, runner, b, context, pages_per_seq, reps) for b in batch_sizes}
    graph: dict[int, float] = {}
    off = graphs_disabled_reason(False, CUDA, backend)
    if off is None:
        runner.capture()
        graph = {b: time_steps(model, runner, b, context, pages_per_seq, reps) for b in batch_sizes}
    else:
        print(f"no CUDA graphs: {off}", file=sys.stderr)
    weights = weight_bytes_per_step(model)
    rows = []
    for b in batch_sizes:
        step_bytes = weights + b * (context + 1) * kv_bytes_per_token(raw)
        floor = step_bytes / (copy_gbps * 1e9) * 1e3
        g = graph.get(b)
        rows.append(StepRow(fmt, b, context, round(eager[b], 3), None if g is None else round(g, 3), round(floor, 3),
                            step_bytes, None if g is None else round(floor / g, 3)))
    del runner, caches
    torch.cuda.empty_cache()
    return rows


# ---- engine and transformers throughput -------------------------------------------------------------
def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


def bench_engine(model: Any, raw: dict[str, Any], fmt: str, num_requests: int, input_len: int,
                 output_len: int) -> ThroughputRow:
    """OfflineEngine over the in-memory model: all requests at once, max_num_seqs = their number."""
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine
    from engine.weights.qwen_tokenizer import default_cache_dir, write_qwen_tokenizer_files
    from scheduler.request import SamplingParams

    tokens = num_requests * (input_len + output_len + BLOCK_SIZE)
    with tempfile.TemporaryDirectory(prefix="fp4serve-bench-gpu-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(raw))
        write_qwen_tokenizer_files(Path(folder), "{{ '' }}", cache_dir=default_cache_dir())
        config = EngineConfig(model=folder, dtype="bfloat16", device="cuda", max_num_seqs=num_requests,
                              max_num_batched_tokens=8192, max_model_len=input_len + output_len + BLOCK_SIZE,
                              kv_cache_memory=str(int(tokens * kv_bytes_per_token(raw) * 1.05)))
        # NOTE: the engine loads weights from its checkpoint folder; this folder has none, and the
        # runner gets the model built in memory instead.
        with mock.patch("engine.model_runner.load_model", lambda *args, **kwargs: model):
            engine = OfflineEngine.from_config(config)
        params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)
        engine.generate(random_prompts(2, 32, raw["vocab_size"], seed=1), SamplingParams(max_tokens=8, temperature=0.0))
        prompts = random_prompts(num_requests, input_len, raw["vocab_size"], seed=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        duration = time.perf_counter() - start
    produced = sum(len(r.token_ids[0]) for r in results)
    note = f"attention {engine.info.attention_backend}"
    del engine
    torch.cuda.empty_cache()
    return ThroughputRow("fp4serve", fmt, num_requests, input_len, output_len, round(duration, 2),
                         round(produced / duration, 1), note)


@torch.inference_mode()
def bench_transformers(raw: dict[str, Any], num_requests: int, input_len: int, output_len: int) -> ThroughputRow:
    """transformers' generate on the same shapes: one static batch, greedy, no early stop."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")}
    with torch.device(CUDA):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**fields), dtype=torch.bfloat16).eval()
    prompts = torch.tensor(random_prompts(num_requests, input_len, raw["vocab_size"], seed=0), device=CUDA)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    model.generate(prompts[:2, :32], max_new_tokens=8, **{**kwargs, "attention_mask": torch.ones_like(prompts[:2, :32])})
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    torch.cuda.synchronize()
    duration = time.perf_counter() - start
    produced = (out.shape[1] - input_len) * num_requests
    del model
    torch.cuda.empty_cache()
    return ThroughputRow("transformers", "bf16", num_requests, input_len, output_len, round(duration, 2),
                         round(produced / duration, 1), "generate, one static batch")


# ---- report -----------------------------------------------------------------------------------------
def print_report(device: str, copy_gbps: float, steps: list[StepRow], throughput: list[ThroughputRow]) -> None:
    print(f"{device}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'format':7} {'batch':>5} {'ctx':>5} | {'eager ms':>9} {'graph ms':>9} | {'floor ms':>9} {'floor/graph':>11}")
    for r in steps:
        graph = "-" if r.graph_ms is None else f"{r.graph_ms:9.2f}"
        frac = "-" if r.graph_fraction_of_floor is None else f"{100 * r.graph_fraction_of_floor:10.0f}%"
        print(f"{r.format:7} {r.batch_size:5d} {r.context:5d} | {r.eager_ms:9.2f} {graph:>9} | {r.floor_ms:9.2f} {frac:>11}")
    for t in throughput:
        print(f"{t.system:12} {t.format:6} {t.num_requests} x {t.input_len}in/{t.output_len}out: "
              f"{t.output_tokens_per_s:8.1f} output tok/s ({t.duration_s:.1f} s; {t.note})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's KV")
    parser.add_argument("--reps", type=int, default=20, help="timed decode steps per point")
    parser.add_argument("--num-requests", type=int, default=64, help="engine/transformers: requests, all in flight")
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=QWEN3_8B["num_hidden_layers"], help="fewer for a quick run")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU (it times FlashInfer, CUDA graphs and the NVFP4 kernel on the device); "
              "on CPU, tests/test_gpu_bookkeeping.py checks the bookkeeping.", file=sys.stderr)
        return 2
    raw = {**QWEN3_8B, "num_hidden_layers": args.layers}
    device = torch.cuda.get_device_name(0)
    copy_gbps = copy_bandwidth_gbps(reps=20)
    steps: list[StepRow] = []
    throughput: list[ThroughputRow] = []
    max_len = max(args.context + 2, args.input_len + args.output_len + BLOCK_SIZE)
    for fmt in args.formats:
        model = build_model(raw, fmt, max_len)
        steps += bench_decode_steps(model, raw, fmt, args.batch_sizes, args.context, copy_gbps, args.reps)
        if not args.skip_engine:
            throughput.append(bench_engine(model, raw, fmt, args.num_requests, args.input_len, args.output_len))
        del model
        torch.cuda.empty_cache()
    if not args.skip_transformers:
        throughput.append(bench_transformers(raw, args.num_requests, args.input_len, args.output_len))
    print_report(device, copy_gbps, steps, throughput)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "copy_gbps": copy_gbps, "steps": [asdict(r) for r in steps],
                                              "throughput": [asdict(t) for t in throughput]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
