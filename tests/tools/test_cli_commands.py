"""The engine subcommands of the `fp4serve` CLI, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.cli import main
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_quantize_writes_a_checkpoint_that_serves_like_quantize_at_load(
    qwen3_ckpt: Path, tmp_path: Path, fmt: str
) -> None:
    dst = tmp_path / "nvfp4"
    assert main(["quantize", str(qwen3_ckpt), str(dst), "--format", fmt, "--device", "cpu"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == ("modelopt" if fmt == "modelopt" else "compressed-tensors")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float32", kv_cache_memory="4MiB")
    written = OfflineEngine.from_config(EngineConfig(model=str(dst), **common))
    at_load = OfflineEngine.from_config(EngineConfig(model=str(qwen3_ckpt), quantization="nvfp4", **common))
    assert written.core.runner.nvfp4_weight_nbytes > 0
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert written.generate(prompt, greedy)[0].token_ids == at_load.generate(prompt, greedy)[0].token_ids


@pytest.mark.slow
def test_help_lists_every_subcommand_without_importing_torch() -> None:
    code = "import sys; from api.cli import build_parser; build_parser().format_help(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    text = subprocess.run(
        [sys.executable, "-m", "api.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("serve", "parse-output", "quantize", "bundle"):
        assert command in text
