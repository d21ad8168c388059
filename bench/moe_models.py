"""`python -m bench moe-models DST`: two random-weight Qwen3-MoE checkpoints with the same tensors,
one routing each token to top-k of its experts and one with every expert active (top_k =
num_experts), so `bench offline` on both shows how a MoE step's cost follows the active experts.
Built with transformers' own classes; the tokenizer is the embedded demo model's."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class MoeShapes:
    num_layers: int = 4
    hidden_size: int = 512
    num_experts: int = 32
    top_k: int = 4
    moe_intermediate_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64


def write_moe_pair(dst: Path, shapes: MoeShapes, seed: int = 0) -> tuple[Path, Path]:
    """(DST/moe-top{k}-of-{E}, DST/moe-all-{E}); the second differs only in num_experts_per_tok."""
    # NOTE: imported here: `python -m bench` loads this module and must not pull torch (test_layering).
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.weights.demo_model import BOS_TOKEN_ID, EOS_TOKEN_ID, ensure_demo_model

    demo = ensure_demo_model()
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=shapes.hidden_size,
        intermediate_size=4 * shapes.hidden_size,
        num_hidden_layers=shapes.num_layers,
        num_attention_heads=shapes.num_heads,
        num_key_value_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim,
        num_experts=shapes.num_experts,
        num_experts_per_tok=shapes.top_k,
        moe_intermediate_size=shapes.moe_intermediate_size,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    sparse = dst / f"moe-top{shapes.top_k}-of-{shapes.num_experts}"
    dense = dst / f"moe-all-{shapes.num_experts}"
    Qwen3MoeForCausalLM(cfg).save_pretrained(sparse, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (demo / name).is_file():
            shutil.copy2(demo / name, sparse / name)
    shutil.copytree(sparse, dense, dirs_exist_ok=True)
    raw = json.loads((dense / "config.json").read_text())
    raw["num_experts_per_tok"] = shapes.num_experts
    (dense / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return sparse, dense


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = MoeShapes()
    p.add_argument("dst", help="folder to write the two checkpoints into")
    p.add_argument("--num-layers", type=int, default=defaults.num_layers, help="decoder layers, all MoE")
    p.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="model width")
    p.add_argument("--num-experts", type=int, default=defaults.num_experts, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="experts per token of the sparse model")
    p.add_argument(
        "--moe-intermediate-size", type=int, default=defaults.moe_intermediate_size, help="each expert's SwiGLU width"
    )


def cmd_moe_models(args: argparse.Namespace) -> int:
    shapes = MoeShapes(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
    )
    for path in write_moe_pair(Path(args.dst), shapes):
        print(f"wrote {path}; run: python -m bench offline --model {path}")
    return 0
