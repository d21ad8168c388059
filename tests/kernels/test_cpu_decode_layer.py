"""The one-op int4 decoder layer (kernels/cpu_decode_layer.cpp) against the same layers run module
by module: the same ops in the same order, so the same logits bit for bit, token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from engine.models.decoder import DecoderLayer
from kernels import cpu_decode_layer
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import capture_logits
from tests.factories import make_checkpoint

PROMPTS = [[5, 17, 42, 99, 7, 300, 12, 64, 1, 250], [3, 8, 120], [44, 2, 91, 7, 7, 15]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fusedlayer"), "llama", tie=True, init_std=0.1)


def run(path: Path, fused: bool, **overrides: object) -> tuple[list[list[int]], dict[str, list[torch.Tensor]], int]:
    e = OfflineEngine.from_config(
        EngineConfig(model=str(path), kv_cache_memory="4MiB", quantization="int4", **overrides)
    )
    layers = [m for m in e.core.runner.model.modules() if isinstance(m, DecoderLayer)]
    switched = sum(m.fused_weights is not None for m in layers)
    if not fused:
        for m in layers:
            m.fused_weights = None
    seen = capture_logits(e)
    results = e.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [r.token_ids[0] for r in results], seen, switched


def test_fused_layers_equal_the_module_path_bit_for_bit(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests decode together (3 rows) after one 19-row step of short prompts (which the
    attention op serves too, so explicit int4, without dense copies, runs it fused as well)."""
    calls: list[int] = []
    op = cpu_decode_layer.decode_layer_int4

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return op(x, *args)

    monkeypatch.setattr(cpu_decode_layer, "decode_layer_int4", counted)
    tokens, logits, switched = run(checkpoint, fused=True)
    assert switched == 2 and 3 in calls  # every layer of the tiny llama; the 3-row decode steps among its calls
    ref_calls = len(calls)
    ref_tokens, ref_logits, _ = run(checkpoint, fused=False)
    assert len(calls) == ref_calls
    assert tokens == ref_tokens
    for rid, steps in ref_logits.items():
        assert all(torch.equal(a, b) for a, b in zip(logits[rid], steps)), rid


def test_layers_with_a_bias_or_padding_stay_module_by_module(tmp_path: Path) -> None:
    """A Qwen3 layer has q/k norms: the fused op does not apply, and the engine still decodes."""
    path = make_checkpoint(tmp_path, "qwen3", tie=True, init_std=0.1)
    tokens, _, switched = run(path, fused=True)
    assert switched == 0 and all(len(t) == 8 for t in tokens)
