"""Random-weight checkpoints with a real model's shapes, written where the benchmark runs: the GPU
server has no model hub, so `bench.gpu`, `bench.gpu_smoke` and scripts/gpu_check.sh build what they
serve from a config alone.

    python -m bench.random_checkpoint qwen3-8b /tmp/q8b [--layers 4] [--device cuda]

The tensor names and shapes come from transformers' own model class for the config (built on the
meta device, so nothing is allocated); the values are drawn here, one tensor at a time, on
`device`, so a 16 GB checkpoint is written without a 16 GB model in memory twice."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# The config fields that shape the compute; the rest are transformers' defaults. Published
# config.json values of each model (Qwen3.6-27B's text part).
SHAPES: Mapping[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": (
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3.6-27b": (
        "Qwen3_5ForCausalLM",
        dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-coder-30b-a3b": (
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            rope_theta=10000000.0,
            tie_word_embeddings=False,
        ),
    ),
}
# The same architectures at a size a 2-core CPU builds in seconds: the rehearsal of a GPU run.
TINY: Mapping[str, dict[str, Any]] = {
    "qwen3-8b": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen3.6-27b": dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "qwen3-coder-30b-a3b": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}
EOS_ID = 151645  # <|im_end|> in the Qwen tokenizer every checkpoint here carries


def config_dict(shape: str, layers: int | None = None, tiny: bool = False) -> dict[str, Any]:
    """The checkpoint's config.json as transformers writes it for `shape`."""
    import transformers

    arch, fields = SHAPES[shape]
    fields = {**fields, **(TINY[shape] if tiny else {})}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if arch == "Qwen3_5ForCausalLM":  # every fourth layer full (gated) attention, as in Qwen3.5/3.6
        n = fields["num_hidden_layers"]
        fields["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    cls = {
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    }[arch]
    cfg = cls(**fields, eos_token_id=EOS_ID, bos_token_id=None)
    raw = cfg.to_dict()
    raw["architectures"] = [arch]
    raw["torch_dtype"] = "bfloat16"
    return raw


def _value(name: str, shape: torch.Size, arch: str, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """A random tensor with the role's scale: weights N(0, 0.02); RMSNorm gains near their identity
    (Qwen3.5's zero-centred norms near 0, the others near 1); DeltaNet decay parameters in range."""
    x = torch.empty(shape, dtype=torch.float32, device=device)
    if name.endswith("norm.weight"):
        centre = 0.0 if arch == "Qwen3_5ForCausalLM" and "linear_attn.norm" not in name else 1.0
        return x.normal_(centre, 0.05, generator=g).to(torch.bfloat16)
    if name.endswith("A_log"):
        return x.uniform_(0.0, 2.7, generator=g).to(
            torch.bfloat16
        )  # A = exp(A_log) in [1, 15], as transformers inits it
    if name.endswith("dt_bias"):
        return x.normal_(0.0, 0.5, generator=g).to(torch.bfloat16)
    return x.normal_(0.0, 0.02, generator=g).to(torch.bfloat16)


def write_random_checkpoint(
    shape: str,
    dst: Path,
    *,
    layers: int | None = None,
    tiny: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Path:
    """config.json, model.safetensors (bf16) and Qwen's tokenizer files in `dst`."""
    import transformers
    from safetensors.torch import save_file

    from engine.weights.qwen_tokenizer import (
        default_cache_dir,
        write_qwen_tokenizer_files,
    )

    raw = config_dict(shape, layers, tiny)
    arch = raw["architectures"][0]
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        model = getattr(transformers, arch)(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {
        name: _value(name, t.shape, arch, torch.device(device), g).cpu() for name, t in model.state_dict().items()
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(raw, indent=1))
    template = (Path(__file__).resolve().parents[1] / "engine" / "templates" / "qwen3_chat.jinja").read_text()
    write_qwen_tokenizer_files(dst, template, cache_dir=default_cache_dir())
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES), help="whose config.json shapes to copy")
    p.add_argument("dst", help="the checkpoint folder to write")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own count)")
    p.add_argument("--tiny", action="store_true", help="the same architecture at a few MB, for a CPU rehearsal")
    p.add_argument("--device", default="cpu", help="where to draw the random values (cuda is much faster)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = write_random_checkpoint(
        args.shape, Path(args.dst), layers=args.layers, tiny=args.tiny, device=args.device, seed=args.seed
    )
    size = (path / "model.safetensors").stat().st_size
    print(f"wrote {path} ({size / 2**30:.2f} GiB of bf16 weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
