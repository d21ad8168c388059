"""Start-up fails with one line naming the field or tensor at fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_weights(path: Path, fn) -> None:  # type: ignore[no-untyped-def]
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def start(path: Path) -> None:
    EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="4MiB"))


def test_unsupported_architecture_names_the_field(qwen3_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(qwen3_ckpt, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match=r"unsupported architecture \['MambaForCausalLM'\] in field 'architectures'"
    ) as e:
        start(path)
    assert "\n" not in str(e.value)


def test_missing_config_field_is_named(qwen3_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(qwen3_ckpt, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        start(path)


def test_missing_tensor_is_named(qwen3_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(qwen3_ckpt, tmp_path / "m")
    edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing tensor for 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        start(path)


def test_misshaped_tensor_is_named_with_both_shapes(qwen3_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(qwen3_ckpt, tmp_path / "m")
    edit_weights(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(
        ConfigError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], expected \[32, 64\]"
    ):
        start(path)


def test_sharded_checkpoint_loads_like_a_single_file(qwen3_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(qwen3_ckpt, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, path / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = EngineCore(EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="4MiB")).runner.model
    b = EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="4MiB")).runner.model
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def test_rope_parameters_of_transformers_5_and_rope_scaling_of_4_read_alike() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rms_norm_eps": 1e-5,
    }
    v4 = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    v5 = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}}
    )
    assert v4.rope == v5.rope and v4.rope.theta == 500000.0 and v4.rope.rope_type == "llama3"
