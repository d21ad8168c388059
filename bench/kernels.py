"""Kernel benchmark: the NVFP4 linear (as the dispatch runs it per M, and each of its paths) against
cuBLAS bf16 on the same values, on Qwen3-8B's and Qwen3.6-27B's linear shapes: time, GB/s, the
fraction of this device's copy bandwidth (measured in the same run), speed against bf16, and
pass/fail against the GPU targets (docs/PERF.md). JSON and a text table.

    python -m bench.kernels --sweep [--out kernels.json]        # M = 1, 16, 64, 256, both models
    python -m bench.kernels --m 1 8 --shapes 8b/o               # a few points
    python -m bench.kernels --device cpu --tiny --sweep         # the rehearsal: interpreted, tiny shapes

On CUDA each timed call starts with a cold L2 (a 256 MiB buffer is rewritten before it), so
weights stream from HBM as they do in a model whose layers do not fit in L2."""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.nvfp4_w4a16 import W4A16Config

# Qwen3-8B: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288.
QWEN3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# Qwen3.6-27B: hidden 5120, intermediate 17408; full attention 24 gated q heads and 4 kv heads of
# 256 (q_proj doubles for the gate); Gated DeltaNet 16 key and 48 value heads of 128 (qkvz).
QWEN36_27B_SHAPES = {
    "attn_qkv": (14336, 5120),
    "o": (5120, 6144),
    "gdn_qkvz": (16384, 5120),
    "gate_up": (34816, 5120),
    "down": (5120, 17408),
}
SHAPES = {**{f"8b/{k}": v for k, v in QWEN3_8B_SHAPES.items()}, **{f"27b/{k}": v for k, v in QWEN36_27B_SHAPES.items()}}
SWEEP_M = (1, 16, 64, 256)
# With --sweep, neighbouring tiles are tried on these shapes only, and only while the run is
# younger than --sweep-budget-s: each new tile shape is a compile, and the device run has about
# 90 s for this step.
SWEEP_SHAPES = ("8b/o", "8b/gate_up", "27b/down")
# The GPU targets: NVFP4's speed over cuBLAS bf16, by M (the largest key <= M applies).
TARGETS = {1: 2.5, 16: 2.0, 64: 1.3, 128: 1.0}
_FLUSH_BYTES = 256 << 20
_COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Row:
    shape: str
    m: int
    n: int
    k: int
    path: str  # what the dispatch runs at this M: "w4a16" or "dequant"
    nvfp4_us: float  # the dispatched path
    nvfp4_gbps: float
    nvfp4_copy_fraction: float
    bf16_us: float
    bf16_gbps: float
    bf16_copy_fraction: float
    speedup: float  # bf16_us / nvfp4_us
    target: float
    passed: bool
    kernel_us: float  # the W4A16 kernel with the chosen tiles
    kernel_config: str
    best_kernel_us: float  # the best tiles the sweep tried
    best_kernel_config: str
    variants: dict[str, float]  # every tile shape the sweep tried -> us
    fp16_dot_us: float | None  # the chosen tiles with fp16 dot operands (the sweep; CUDA only)
    dequant_us: float | None  # dequantize + cuBLAS (M >= 64 only)
    max_rel_error: float


def target_for(m: int) -> float:
    return TARGETS[max(t for t in TARGETS if t <= m)]


def time_us(fn: Callable[[], object], flush: torch.Tensor, warmup: int, reps: int) -> float:
    """Median over reps of one call, each after rewriting `flush` (CUDA events around the call only;
    wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if not flush.is_cuda:
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_bandwidth_gbps(reps: int, device: torch.device | str = "cuda", nbytes: int = _COPY_BYTES) -> float:
    """Device-to-device copy: bytes read plus bytes written per second (bench.gpu uses it too)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), torch.empty(0, device=device), warmup=3, reps=reps)
    return 2 * nbytes / us / 1e3


def sweep_configs(chosen: "W4A16Config") -> list["W4A16Config"]:
    """A few neighbours of the chosen tiles: the other decode (joined or lanes), the other row
    tile (64 or 128), the other K step (128 or 256), twice the slices."""
    return [
        replace(chosen, lanes=not chosen.lanes),
        replace(chosen, block_n=128 if chosen.block_n == 64 else 64),
        replace(chosen, halves=4 if chosen.halves == 2 else 2),
        replace(chosen, split_k=2 * chosen.split_k),
    ]


def bench_point(
    name: str, m: int, n: int, k: int, copy_gbps: float, flush: torch.Tensor, warmup: int, reps: int, sweep: bool
) -> Row:
    from kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from kernels.nvfp4_dequant import dequantize_layout
    from kernels.nvfp4_matmul import matmul_path, nvfp4_linear_prepared
    from kernels.nvfp4_triton import pack_kernel_layout
    from kernels.nvfp4_w4a16 import choose_config, w4a16_matmul

    device = flush.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's dots: fp16
    g = torch.Generator(device=device).manual_seed(m * 131 + n)
    w = quantize_nvfp4(torch.randn(n, k, generator=g, device=device) * 0.02)
    layout = pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    w_dense = dequantize_nvfp4(w, dtype)  # [N, K]: cuBLAS's operand, the same values
    del w
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = torch.nn.functional.linear(x.float(), w_dense.float())

    def error(got: torch.Tensor) -> float:
        return ((got.float() - want).norm() / want.norm()).item()

    chosen = choose_config(m, n, k, num_sms)
    errors = [error(nvfp4_linear_prepared(x, layout))]
    kernel_us = best_us = time_us(lambda: w4a16_matmul(x, layout, config=chosen), flush, warmup, reps)
    best, variants, fp16_dot_us = chosen, {chosen.describe(): round(kernel_us, 2)}, None
    for config in sweep_configs(chosen) if sweep else []:
        errors.append(error(w4a16_matmul(x, layout, config=config)))
        us = time_us(lambda: w4a16_matmul(x, layout, config=config), flush, warmup, reps)  # noqa: B023  (timed at once)
        variants[config.describe()] = round(us, 2)
        if us < best_us:
            best_us, best = us, config
    if sweep and device.type == "cuda":  # fp16 operands would skip a cast per weight; bf16's range is why not
        fp16 = lambda: w4a16_matmul(x, layout, config=chosen, dot_dtype=torch.float16)  # noqa: E731
        errors.append(error(fp16()))
        fp16_dot_us = time_us(fp16, flush, warmup, reps)
    dequant_us = None
    if m >= 64:
        dense = lambda: torch.nn.functional.linear(x, dequantize_layout(layout, dtype))  # noqa: E731
        errors.append(error(dense()))
        dequant_us = time_us(dense, flush, warmup, reps)
    path = matmul_path(m)
    nvfp4_us = time_us(lambda: nvfp4_linear_prepared(x, layout), flush, warmup, reps)
    bf16_us = time_us(lambda: torch.nn.functional.linear(x, w_dense), flush, warmup, reps)

    activation_bytes = (m * k + m * n) * 2  # 16-bit in and out
    nvfp4_gbps = (layout.nbytes + activation_bytes) / nvfp4_us / 1e3
    bf16_gbps = (w_dense.nbytes + activation_bytes) / bf16_us / 1e3
    speedup = bf16_us / nvfp4_us
    return Row(
        name,
        m,
        n,
        k,
        path,
        round(nvfp4_us, 2),
        round(nvfp4_gbps, 1),
        round(nvfp4_gbps / copy_gbps, 3),
        round(bf16_us, 2),
        round(bf16_gbps, 1),
        round(bf16_gbps / copy_gbps, 3),
        round(speedup, 2),
        target_for(m),
        speedup >= target_for(m),
        round(kernel_us, 2),
        chosen.describe(),
        round(best_us, 2),
        best.describe(),
        variants,
        None if fp16_dot_us is None else round(fp16_dot_us, 2),
        None if dequant_us is None else round(dequant_us, 2),
        round(max(errors), 5),
    )


def print_table(rows: list[Row], copy_gbps: float, device: str) -> None:
    print(f"{device}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    header = (
        f"{'shape':13} {'M':>4} {'N':>6} {'K':>6} {'path':>7} | {'nvfp4 us':>9} {'%copy':>6} | "
        f"{'bf16 us':>8} {'%copy':>6} | {'speed':>6} {'target':>6}      | {'kernel':>7} {'best':>7} "
        f"{'dequant':>8} {'rel err':>8}  best tiles"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        dequant = "-" if r.dequant_us is None else f"{r.dequant_us:.1f}"
        print(
            f"{r.shape:13} {r.m:4d} {r.n:6d} {r.k:6d} {r.path:>7} | {r.nvfp4_us:9.1f} "
            f"{100 * r.nvfp4_copy_fraction:5.1f}% | {r.bf16_us:8.1f} {100 * r.bf16_copy_fraction:5.1f}% | "
            f"{r.speedup:5.2f}x {r.target:5.1f}x {'pass' if r.passed else 'FAIL':4} | {r.kernel_us:7.1f} "
            f"{r.best_kernel_us:7.1f} {dequant:>8} {r.max_rel_error:8.5f}  {r.best_kernel_config}"
        )
    print(f"{sum(r.passed for r in rows)}/{len(rows)} points meet their target")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=list(SWEEP_M), help="token counts (rows of x)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--sweep", action="store_true", help=f"also time a few neighbouring tiles on {', '.join(SWEEP_SHAPES)}"
    )
    parser.add_argument(
        "--sweep-budget-s", type=float, default=60.0, help="try no more neighbouring tiles once the run is this old"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tiny", action="store_true", help="N / 64 and K / 16 (the CPU rehearsal: several K slices, a ragged K)"
    )
    parser.add_argument("--out", help="write the rows, the copy bandwidth and the verdict as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench.kernels: no CUDA device; `--device cpu --tiny` rehearses it under TRITON_INTERPRET=1.",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu":
        # Before the kernel modules are imported (bench_point imports them): see kernels.nvfp4_triton.
        os.environ["TRITON_INTERPRET"] = "1"
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 2)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    copy_gbps = copy_bandwidth_gbps(max(args.reps, 5), device, _COPY_BYTES if device.type == "cuda" else 64 << 20)
    flush = torch.empty(_FLUSH_BYTES if device.type == "cuda" else 0, dtype=torch.uint8, device=device)
    started = time.perf_counter()
    rows: list[Row] = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        if args.tiny:
            n, k = max(16, n // 64), max(512, k // 16)
        for m in args.m:
            sweep = args.sweep and shape in SWEEP_SHAPES and time.perf_counter() - started < args.sweep_budget_s
            rows.append(bench_point(shape, m, n, k, copy_gbps, flush, args.warmup, args.reps, sweep))
            print(f"  {shape} M={m}: {rows[-1].speedup}x bf16 ({rows[-1].path})", file=sys.stderr, flush=True)
            if args.out:  # after every point: a run cut short by its time budget still reports
                write_report(args.out, name, copy_gbps, rows, time.perf_counter() - started)
    print_table(rows, copy_gbps, name)
    return 0


def write_report(path: str, device: str, copy_gbps: float, rows: list[Row], seconds: float) -> None:
    report = {
        "device": device,
        "copy_gbps": round(copy_gbps, 1),
        "targets": TARGETS,
        "passed": all(r.passed for r in rows),
        "points_passed": sum(r.passed for r in rows),
        "seconds": round(seconds, 1),
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
