"""Kernel benchmark: the NVFP4 W4A16 Triton matmul against torch's bf16 matmul at Qwen3-8B's
linear shapes, as time, achieved GB/s and a fraction of this device's measured copy bandwidth.

    python -m bench.kernels [--m 1 8 16] [--out results.json] [--sweep]

CUDA only. Each timed call starts with a cold L2 (a 256 MiB buffer is rewritten before it),
so weights stream from HBM as they do in a model whose layers do not fit in L2."""

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# Qwen3-8B: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288.
QWEN3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
DEFAULT_M = (1, 8, 16, 32, 64, 256)
_FLUSH_BYTES = 256 << 20
_COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Row:
    shape: str
    m: int
    n: int
    k: int
    nvfp4_us: float
    nvfp4_gbps: float
    nvfp4_copy_fraction: float
    bf16_us: float
    bf16_gbps: float
    speedup: float
    max_rel_error: float
    config: str


def time_us(fn: Callable[[], object], flush: torch.Tensor, warmup: int, reps: int) -> float:
    """Median over reps of one call, each after rewriting `flush` (CUDA events around the call only)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_bandwidth_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB: bytes read plus bytes written per second."""
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    no_flush = torch.empty(0, device="cuda")
    us = time_us(lambda: dst.copy_(src), no_flush, warmup=3, reps=reps)
    return 2 * _COPY_BYTES / us / 1e3


def bench_point(name: str, m: int, n: int, k: int, copy_gbps: float, flush: torch.Tensor,
                warmup: int, reps: int, sweep: bool) -> Row:
    from kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from kernels.nvfp4_triton import W4A16Config, choose_config, pack_kernel_layout, w4a16_matmul

    g = torch.Generator(device="cuda").manual_seed(m * 131 + n)
    w = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)
    layout = pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    w_bf16 = dequantize_nvfp4(w, torch.bfloat16)  # [N, K] bf16: torch's operand, same values
    del w
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    configs = [choose_config(m, n, k, num_sms)]
    if sweep:
        configs += [W4A16Config(configs[0].block_m, block_n, split_k, 8 if block_n > 128 else 4, 4)
                    for block_n in (64, 128, 256) for split_k in (1, 2, 4, 8, 16)]
    want = torch.nn.functional.linear(x.float(), w_bf16.float())
    best_us, best_config, error = float("inf"), configs[0], 0.0
    for config in configs:
        got = w4a16_matmul(x, layout, config=config)
        error = max(error, ((got.float() - want).norm() / want.norm()).item())
        us = time_us(lambda: w4a16_matmul(x, layout, config=config), flush, warmup, reps)
        if us < best_us:
            best_us, best_config = us, config
    bf16_us = time_us(lambda: torch.nn.functional.linear(x, w_bf16), flush, warmup, reps)

    activation_bytes = (m * k + m * n) * 2  # bf16 in and out
    nvfp4_gbps = (layout.nbytes + activation_bytes) / best_us / 1e3
    bf16_gbps = (w_bf16.nbytes + activation_bytes) / bf16_us / 1e3
    c = best_config
    return Row(name, m, n, k, round(best_us, 2), round(nvfp4_gbps, 1), round(nvfp4_gbps / copy_gbps, 3),
               round(bf16_us, 2), round(bf16_gbps, 1), round(bf16_us / best_us, 2), round(error, 5),
               f"m{c.block_m} n{c.block_n} s{c.split_k} w{c.num_warps} st{c.num_stages}")


def print_table(rows: list[Row], copy_gbps: float, device: str) -> None:
    print(f"{device}; device copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    header = (f"{'shape':8} {'M':>4} {'N':>6} {'K':>6} | {'nvfp4 us':>9} {'GB/s':>7} {'%copy':>6} | "
              f"{'bf16 us':>8} {'GB/s':>7} | {'speedup':>7} {'rel err':>8}  config")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.shape:8} {r.m:4d} {r.n:6d} {r.k:6d} | {r.nvfp4_us:9.1f} {r.nvfp4_gbps:7.0f} "
              f"{100 * r.nvfp4_copy_fraction:5.1f}% | {r.bf16_us:8.1f} {r.bf16_gbps:7.0f} | "
              f"{r.speedup:6.2f}x {r.max_rel_error:8.5f}  {r.config}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_M), help="token counts (rows of x)")
    parser.add_argument("--shapes", nargs="+", default=list(QWEN3_8B_SHAPES), choices=list(QWEN3_8B_SHAPES))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also try 15 tile/split configs, report the best")
    parser.add_argument("--out", help="write the rows and the copy bandwidth as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU (the Triton kernel is compiled for the device); "
              "on CPU, tests/test_nvfp4_matmul.py checks it under TRITON_INTERPRET=1.", file=sys.stderr)
        return 2

    device = torch.cuda.get_device_name(0)
    copy_gbps = copy_bandwidth_gbps(args.reps)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = [bench_point(name, m, *QWEN3_8B_SHAPES[name], copy_gbps, flush, args.warmup, args.reps, args.sweep)
            for name in args.shapes for m in args.m]
    print_table(rows, copy_gbps, device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "copy_gbps": copy_gbps, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
