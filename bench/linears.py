"""`python -m bench.linears --model FOLDER`: a dense model's linear layers alone, per weight format
(float32, bfloat16, float16, int8 per-channel with float32/bf16/fp16 activations), at the batch sizes
given, per layer kind summed over all layers, and the lm_head. Formats are timed interleaved, round
by round, so a noisy neighbour on a shared CPU slows every format alike; the fastest round is kept
(the one least disturbed).

Random weights of the model's shapes: the time of a matmul does not depend on the values."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# format name -> (weight dtype or "int8", activation dtype)
FORMATS: dict[str, tuple[torch.dtype | str, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "int8 (f32 act)": ("int8", torch.float32),
    "int8 (bf16 act)": ("int8", torch.bfloat16),
    "int8 (fp16 act)": ("int8", torch.float16),
}


def layer_kinds(cfg: Any) -> dict[str, tuple[int, int]]:
    """Each dense layer's linears as the engine fuses them: kind -> (out_features, in_features)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv_proj": (q + 2 * kv, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, q),
        "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }


def make_op(
    fmt: str, shape: tuple[int, int], lm_head_t: bool = False
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]:
    from engine.weights.formats.int8_linear import Int8Linear  # lazily: bench/ imports engine/ only in its functions

    wdtype, adtype = FORMATS[fmt]
    weight = torch.randn(shape) * 0.05  # [N, K] float32
    if wdtype == "int8":
        linear = Int8Linear.from_float(weight, None, adtype)
        return linear, adtype
    w = weight.to(wdtype)
    if lm_head_t:  # the engine's CPU logits matmul: hidden @ a contiguous [K, N] copy
        wt = w.t().contiguous()
        return (lambda x: x @ wt), adtype
    return (lambda x: F.linear(x, w)), adtype


def time_op(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeat: int) -> float:
    op(x)
    start = time.perf_counter()
    for _ in range(repeat):
        op(x)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF folder (its config.json gives the shapes)")
    p.add_argument("--batch", default="1,32", help="batch sizes (tokens per forward), comma separated")
    p.add_argument(
        "--formats",
        default="float32,bfloat16,int8 (f32 act),int8 (bf16 act)",
        help="comma separated, of: " + ", ".join(FORMATS),
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20, help="calls per timing")
    args = p.parse_args()
    from engine.weights.config.model_config import ModelConfig

    cfg = ModelConfig.from_checkpoint(Path(args.model))
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    kinds = {**layer_kinds(cfg), "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    torch.manual_seed(0)
    ops = {
        (fmt, kind): make_op(fmt, shape, lm_head_t=kind == "lm_head")
        for fmt in formats
        for kind, shape in kinds.items()
    }
    print(
        f"{cfg.architecture}, {cfg.num_layers} layers; threads {torch.get_num_threads()}; "
        f"times in ms per forward (layer kinds x {cfg.num_layers} layers), best of {args.rounds} rounds"
    )
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch.split(",")):
            times: dict[tuple[str, str], list[float]] = {key: [] for key in ops}
            for _ in range(args.rounds):
                for (fmt, kind), (op, adtype) in ops.items():
                    x = torch.randn(batch, kinds[kind][1]).to(adtype)
                    times[fmt, kind].append(time_op(op, x, args.repeat))
            print(f"\nbatch {batch}")
            print("| format | " + " | ".join(kinds) + " | all layers | + lm_head |")
            print("|---|" + "---:|" * (len(kinds) + 2))
            for fmt in formats:
                ms = {kind: min(times[fmt, kind]) * 1e3 for kind in kinds}
                body = {k: v * cfg.num_layers for k, v in ms.items() if k != "lm_head"}
                total = sum(body.values())
                cells = [f"{v:.2f}" for v in body.values()] + [
                    f"{ms['lm_head']:.2f}",
                    f"{total:.2f}",
                    f"{total + ms['lm_head']:.2f}",
                ]
                print(f"| {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
