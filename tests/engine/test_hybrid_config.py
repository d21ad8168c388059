"""Reading hybrid (Qwen3.5/3.6) configs: both layouts, the DeltaNet fields, bad fields named in
one line; the state size per slot; the linear-attention backend choice on a machine without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.hybrid_runner import choose_linear_backend
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig

TEXT: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    eos_token_id=7,
    rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"},
)


def test_causal_lm_layout_defaults_to_three_deltanet_layers_per_attention_layer() -> None:
    cfg = ModelConfig.from_dict({**TEXT, "architectures": ["Qwen3_5ForCausalLM"]})
    h = cfg.hybrid
    assert h is not None and cfg.model_type == "qwen3_5" and not h.has_vision
    assert h.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (h.linear_layers, h.attention_layers, cfg.num_kv_layers) == ([0, 1, 2], [3], 1)
    assert cfg.rotary_dim == 4 and cfg.rope.theta == 1e7
    # conv [2*2*16 + 6*8 = 112 channels, 3] + recurrent [6, 16, 8], float32, 3 layers
    assert h.state_bytes_per_slot() == 4 * 3 * (112 * 3 + 6 * 16 * 8)


def test_conditional_generation_layout_reads_text_config_and_top_level_tie() -> None:
    raw = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": True,
        "text_config": {
            **TEXT,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention", "linear_attention"] * 2,
        },
        "vision_config": {"depth": 1},
    }
    cfg = ModelConfig.from_dict(raw)
    assert cfg.hybrid is not None and cfg.hybrid.has_vision and cfg.tie_word_embeddings
    assert cfg.hybrid.attention_layers == [0, 2] and cfg.eos_token_ids == (7,)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("linear_num_value_heads", 5, "must be a multiple of linear_num_key_heads"),
        ("layer_types", ["full_attention"] * 3, "must name 4 layers"),
        ("layer_types", ["mamba"] * 4, "must name 4 layers"),
        ("layer_types", ["linear_attention"] * 4, "has no 'full_attention' layer"),
        ("linear_conv_kernel_dim", None, "'linear_conv_kernel_dim' must be a positive integer"),
    ],
)
def test_bad_hybrid_field_is_named(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**TEXT, field: value, "architectures": ["Qwen3_5ForCausalLM"]})


def test_linear_attention_backend_on_cpu_is_torch_and_fla_is_refused() -> None:
    assert choose_linear_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ConfigError, match="--linear-attention-backend fla: the device is cpu"):
        choose_linear_backend("fla", torch.device("cpu"))
    with pytest.raises(ConfigError, match="--num-state-slots"):
        EngineConfig(num_state_slots=0)
