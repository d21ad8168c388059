"""`python -m bench.short_rows`: the gated delta rule's two torch forms on rows of L tokens, to pick
engine/attention/linear_attention.py SHORT_ROW_MAX: the chunked form (engine/attention/gated_delta.py
chunk_gated_delta_rule, one padded chunk of 64 for short rows) against the token-by-token
recurrence (sequential_gated_delta_rule), at a tiny test model's DeltaNet sizes and at
Qwen3.5-class sizes (16 key heads, 32 value heads, head dims 128). Fastest of --repeats calls,
both forms interleaved; also checks that they agree."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

SHAPES = {  # name: (batch, key heads, value heads, head_k_dim, head_v_dim)
    "tiny-1": (1, 1, 2, 8, 4),
    "small-4": (4, 2, 4, 32, 32),
    "qwen3.5-1": (1, 16, 32, 128, 128),
    "qwen3.5-4": (4, 16, 32, 128, 128),
}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="1,2,4,6,8,12,16,24,32", help="comma-separated row lengths L")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per form; the fastest is reported")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import torch

    from engine.attention.gated_delta import chunk_gated_delta_rule, sequential_gated_delta_rule

    rows = []
    for name in args.shapes.split(","):
        b, hk, hv, dk, dv = SHAPES[name]
        for length in (int(x) for x in args.lengths.split(",")):
            g = torch.Generator().manual_seed(length)
            q, k = torch.randn(b, length, hk, dk, generator=g), torch.randn(b, length, hk, dk, generator=g)
            v = torch.randn(b, length, hv, dv, generator=g)
            decay, beta = -torch.rand(b, length, hv, generator=g), torch.rand(b, length, hv, generator=g)
            state = torch.randn(b, hv, dk, dv, generator=g)
            chunked = partial(chunk_gated_delta_rule, q, k, v, decay, beta, state)
            recurrence = partial(sequential_gated_delta_rule, q, k, v, decay, beta, state)
            times: dict[str, float] = {"chunked": float("inf"), "recurrence": float("inf")}
            for _ in range(3):  # interleaved rounds: load from other jobs hits both forms alike
                times["chunked"] = min(times["chunked"], best_ms(chunked, args.repeats))
                times["recurrence"] = min(times["recurrence"], best_ms(recurrence, args.repeats))
            (o1, s1), (o2, s2) = chunked(), recurrence()
            row = {
                "shape": name,
                "batch": b,
                "L": length,
                "chunked_ms": round(times["chunked"], 3),
                "recurrence_ms": round(times["recurrence"], 3),
                "chunked_over_recurrence": round(times["chunked"] / times["recurrence"], 2),
                "max_abs_diff": float(max((o1 - o2).abs().max(), (s1 - s2).abs().max())),
            }
            rows.append(row)
            print(
                f"{name:10} L={length:3} chunked={row['chunked_ms']:9.3f} ms "
                f"recurrence={row['recurrence_ms']:9.3f} ms "
                f"ratio={row['chunked_over_recurrence']:7.2f} diff={row['max_abs_diff']:.1e}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
