"""The checkpoint's config: `ModelConfig` and `RopeConfig`, read from a model folder's config.json
(and the extra EOS ids of its generation_config.json)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.weights.config.hybrid_config import (
    HYBRID_ARCHITECTURES,
    HYBRID_MOE_ARCHITECTURES,
    HybridConfig,
    hybrid_from_dict,
    text_fields,
)
from engine.weights.config.moe_config import MoeConfig, moe_config_from_dict

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    **{arch: "qwen3_5" for arch in HYBRID_ARCHITECTURES},
    "Qwen3MoeForCausalLM": "qwen3_moe",
    **{arch: "qwen3_5_moe" for arch in HYBRID_MOE_ARCHITECTURES},
}
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# our model_type -> the MoE config's model_type (Qwen3.5-MoE's text config: qwen3_5_moe_text)
_MOE_CONFIG_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str  # "qwen3" | "llama" | "qwen3_5" | "qwen3_moe" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str  # as written in the checkpoint: "bfloat16", "float32", ...
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization: dict[str, Any] | None = None  # the checkpoint's quantization config, if any
    hybrid: HybridConfig | None = None  # Qwen3.5/3.6: Gated DeltaNet layers beside gated attention
    moe: MoeConfig | None = None  # mixture-of-experts models: experts, top-k, which layers are sparse

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged KV cache (a hybrid model's DeltaNet layers keep state slots instead)."""
        return len(self.hybrid.attention_layers) if self.hybrid is not None else self.num_layers

    @property
    def rotary_dim(self) -> int:
        """The leading part of head_dim that RoPE rotates (all of it, except with partial RoPE)."""
        return int(self.head_dim * self.hybrid.partial_rotary_factor) if self.hybrid is not None else self.head_dim

    @staticmethod
    def from_checkpoint(path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found (a model folder needs config.json)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file}: invalid JSON ({e})") from None
        return ModelConfig.from_dict(raw, source=str(cfg_file), folder=path)

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json", folder: Path | None = None) -> ModelConfig:
        def need(key: str, kind: type = int) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: missing field '{key}'")
            value = raw[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{source}: field '{key}' must be an integer, got {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: field '{key}' must be a number, got {value!r}")
            return value

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or '(none given)'} in field 'architectures'; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        hybrid = None
        if model_type in HYBRID_MODEL_TYPES:
            has_vision = isinstance(raw.get("vision_config"), dict)
            raw = text_fields(raw)
            hybrid = dataclasses.replace(hybrid_from_dict(raw, source), has_vision=has_vision)
        hidden = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        head_dim = raw.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{source}: field 'num_key_value_heads' ({num_kv_heads}) must divide num_attention_heads ({num_heads})"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        if folder is not None:
            eos_ids = _merge_generation_eos(folder, eos_ids)
        try:
            moe = moe_config_from_dict(raw, _MOE_CONFIG_TYPE.get(model_type, model_type), source)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=_dense_width(raw, moe, need),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("rms_norm_eps", float)),
            max_position_embeddings=raw.get("max_position_embeddings") or 4096,
            rope=_rope_config(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            quantization=raw.get("quantization_config"),
            hybrid=hybrid,
            moe=moe,
        )


def _dense_width(raw: dict[str, Any], moe: MoeConfig | None, need: Any) -> int:
    """The dense MLP width. Qwen3.5-MoE has no dense MLP (every layer is sparse) and no
    `intermediate_size`: its one dense SwiGLU is the shared expert, so that width stands in."""
    if raw.get("intermediate_size") is None and moe is not None and moe.shared_expert_intermediate_size:
        return moe.shared_expert_intermediate_size
    return need("intermediate_size")


def _merge_generation_eos(folder: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json often lists more EOS ids than config.json (Llama 3 chat)."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return eos_ids
    try:
        value = json.loads(gen.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return eos_ids
    extra = value if isinstance(value, list) else ([value] if isinstance(value, int) else [])
    return tuple(dict.fromkeys([*eos_ids, *extra]))


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older, `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"{source}: unsupported rope type '{rope_type}' in field 'rope_scaling'")
    if rope_type != "default" and "factor" not in merged:
        raise ConfigError(f"{source}: rope type '{rope_type}' needs 'factor' in field 'rope_scaling'")
    fields = {k: merged[k] for k in RopeConfig.__dataclass_fields__ if k in merged and k not in ("theta", "rope_type")}
    if rope_type == "default":
        fields.pop("factor", None)
    return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)
