"""Loading Qwen3.5 hybrid checkpoints: what a text server leaves out is named in one start-up line
each (vision tower, MTP head), and a missing or mis-shaped DeltaNet tensor fails with one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.model_runner import ModelRunner
from engine.weights.config.model_config import ModelConfig
from tests.factories import make_hybrid_checkpoint


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("vl"), layout="vl")


def copy_with(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of the checkpoint with tensors added, replaced, or (None) removed."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def load(path: Path) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="1MiB", max_num_seqs=2)
    return ModelRunner(path, ModelConfig.from_checkpoint(path), config, max_model_len=64)


def test_vision_and_mtp_weights_are_skipped_with_one_line_each(
    vl_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mtp = {"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.zeros(64)}
    path = copy_with(vl_ckpt, tmp_path / "m", mtp)  # type: ignore[arg-type]
    num_vision = sum(1 for n in load_file(path / "model.safetensors") if n.startswith("model.visual."))
    with caplog.at_level(logging.INFO):
        runner = load(path)
    text = caplog.text
    assert f"skipped {num_vision} vision tensors (model.visual.*" in text
    assert "skipped 2 MTP tensors (mtp.*): not loaded until speculative decoding uses them" in text
    assert "ignored" not in text  # every other tensor found its place
    assert "state slots: 2 x" in text
    assert not any("visual" in n or "mtp" in n for n, _ in runner.model.named_parameters())


def test_a_missing_deltanet_tensor_is_named(vl_ckpt: Path, tmp_path: Path) -> None:
    path = copy_with(vl_ckpt, tmp_path / "m", {"model.language_model.layers.1.linear_attn.A_log": None})
    with pytest.raises(ConfigError, match=r"missing tensor for 'model\.layers\.1\.linear_attn\.A_log'"):
        load(path)


def test_a_misshaped_conv_weight_is_named(vl_ckpt: Path, tmp_path: Path) -> None:
    name = "model.language_model.layers.0.linear_attn.conv1d.weight"
    bad = torch.zeros(load_file(vl_ckpt / "model.safetensors")[name].shape[0], 1, 5)
    path = copy_with(vl_ckpt, tmp_path / "m", {name: bad})
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.0\.linear_attn\.conv1d\.weight' has shape"):
        load(path)
