"""The hybrid (Qwen3.5 / Qwen3.6) part of a checkpoint's config: which layers are Gated DeltaNet
and which gated attention, the DeltaNet head sizes, and the per-sequence recurrent state they
need. `text_fields` flattens a ConditionalGeneration config's `text_config` for `ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
# The same hybrid layers with a sparse MoE block (and a shared expert) in every MLP slot.
HYBRID_MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) | "full_attention"
    num_k_heads: int  # DeltaNet query/key heads
    num_v_heads: int  # DeltaNet value heads (a multiple of num_k_heads: grouped value attention)
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # the causal depthwise conv over q, k, v
    partial_rotary_factor: float  # the gated-attention layers rotate this fraction of head_dim
    has_vision: bool  # ConditionalGeneration: model.visual.* is in the checkpoint (not served)

    def __post_init__(self) -> None:
        assert self.num_v_heads % self.num_k_heads == 0, "value heads must be a multiple of key heads"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k and v side by side)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    def state_bytes_per_slot(self) -> int:
        """One sequence's float32 state over all DeltaNet layers: conv [conv_dim, kernel-1] plus
        recurrent [v_heads, k_dim, v_dim] per layer."""
        per_layer = self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.head_k_dim * self.head_v_dim
        return 4 * per_layer * len(self.linear_layers)


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: a ConditionalGeneration config nests them in `text_config`;
    top-level tie_word_embeddings and eos ids (where given) win, as transformers reads them."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = {**text, "architectures": raw.get("architectures")}
    for key in ("tie_word_embeddings", "quantization_config", "torch_dtype", "dtype"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    if merged.get("eos_token_id") is None and raw.get("eos_token_id") is not None:
        merged["eos_token_id"] = raw["eos_token_id"]
    return merged


def hybrid_from_dict(raw: dict[str, Any], source: str) -> HybridConfig:
    """HybridConfig from the (flattened) text fields; a missing or bad field is a ConfigError."""

    def need(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
        return value

    num_layers = need("num_hidden_layers")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = raw.get("full_attention_interval") or 4
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in layer_types):
        raise ConfigError(
            f"{source}: field 'layer_types' must name {num_layers} layers, each "
            f"'{LINEAR_ATTENTION}' or '{FULL_ATTENTION}'"
        )
    if FULL_ATTENTION not in layer_types:
        # NOTE: the KV cache and the runner assume at least one attention layer.
        raise ConfigError(f"{source}: field 'layer_types' has no '{FULL_ATTENTION}' layer; fp4serve needs one")
    num_k, num_v = need("linear_num_key_heads"), need("linear_num_value_heads")
    if num_v % num_k:
        raise ConfigError(
            f"{source}: field 'linear_num_value_heads' ({num_v}) must be a multiple of linear_num_key_heads ({num_k})"
        )
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    return HybridConfig(
        layer_types=tuple(layer_types),
        num_k_heads=num_k,
        num_v_heads=num_v,
        head_k_dim=need("linear_key_head_dim"),
        head_v_dim=need("linear_value_head_dim"),
        conv_kernel=need("linear_conv_kernel_dim"),
        partial_rotary_factor=factor,
        has_vision=False,
    )
