"""The mixture-of-experts part of a model's configuration (`MoeConfig`), read from config.json:
how many experts, how many route per token, their size, and which layers are sparse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> whether its router always renormalizes the top-k probabilities (Qwen3.5-MoE's text
# config does, and has a shared expert; qwen3_moe follows `norm_topk_prob`).
MOE_MODEL_TYPES = {"qwen3_moe": False, "qwen3_5_moe_text": True}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here
    shared_expert_intermediate_size: int = 0  # > 0: a sigmoid-gated shared expert (Qwen3.5-MoE)

    def __post_init__(self) -> None:
        assert 0 < self.num_experts_per_tok <= self.num_experts, (
            f"top-k {self.num_experts_per_tok} of {self.num_experts} experts"
        )
        assert self.decoder_sparse_step >= 1, f"decoder_sparse_step={self.decoder_sparse_step}"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule (Qwen3MoeDecoderLayer): which layers hold a sparse MoE block."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def moe_config_from_dict(raw: dict[str, Any], model_type: str, source: str) -> MoeConfig | None:
    """The MoE fields of config.json, or None for a dense model type. Raises ValueError naming the
    field; engine.weights.config.model_config turns it into its ConfigError."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    # transformers >= 5 writes `num_local_experts`; released Qwen checkpoints say `num_experts`.
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "moe_intermediate_size": raw.get("moe_intermediate_size"),
    }
    for key, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(
            f"{source}: field 'num_experts_per_tok' ({fields['num_experts_per_tok']}) exceeds "
            f"num_experts ({fields['num_experts']})"
        )
    if model_type == "qwen3_5_moe_text":  # every layer is sparse (its config has no layer-choice fields)
        raw = {k: v for k, v in raw.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
    step = raw.get("decoder_sparse_step") or 1
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{source}: field 'decoder_sparse_step' must be a positive integer, got {step!r}")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    always_norm = MOE_MODEL_TYPES[model_type]
    return MoeConfig(
        num_experts=fields["num_experts"],
        num_experts_per_tok=fields["num_experts_per_tok"],
        moe_intermediate_size=fields["moe_intermediate_size"],
        norm_topk_prob=always_norm or bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(only),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )
