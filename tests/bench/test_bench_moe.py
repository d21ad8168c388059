"""`python -m bench moe-models`: a MoE checkpoint and its every-expert-active twin hold the same
tensors and differ only in top-k; `bench offline` runs on both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bench.__main__ import main

pytestmark = pytest.mark.slow


def test_moe_models_differ_only_in_top_k_and_run_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "moe-models",
                str(tmp_path),
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-experts",
                "4",
                "--top-k",
                "1",
                "--moe-intermediate-size",
                "16",
            ]
        )
        == 0
    )
    sparse, dense = tmp_path / "moe-top1-of-4", tmp_path / "moe-all-4"
    a, b = json.loads((sparse / "config.json").read_text()), json.loads((dense / "config.json").read_text())
    assert (a.pop("num_experts_per_tok"), b.pop("num_experts_per_tok")) == (1, 4) and a == b
    ta, tb = load_file(sparse / "model.safetensors"), load_file(dense / "model.safetensors")
    assert ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ta
    for path in (sparse, dense):
        assert (
            main(
                [
                    "offline",
                    "--model",
                    str(path),
                    "--dtype",
                    "float32",
                    "--num-requests",
                    "2",
                    "--input-len",
                    "8",
                    "--output-len",
                    "2",
                    "--kv-cache-memory",
                    "8MiB",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    assert out.count("forward") == 2 and "moe-all-4" in out
