"""MoE models keep their decode CUDA graphs (engine/models/moe.py on the CUDA path: the float32
router, kernels/fused_moe.py `moe_align_block_size` and the Triton grouped GEMMs of
kernels/fused_moe_triton.py): captured on CPU by the strict stand-in of tests/graph_fakes.py, with
the Triton kernels interpreted, the forward runs no host-syncing op and no data-dependent shape, so
one graph serves every routing. The grouped torch reference, which reads per-expert counts back
to the host, is what the check catches."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import engine.models.moe as moe_module
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch
from engine.cuda_graph import CudaGraphRunner, DecodeBuckets
from engine.weights.config.model_config import ModelConfig
from engine.weights.loader import load_model
from tests.factories import forward_batch, make_moe_checkpoint
from tests.graph_fakes import GraphableTorchBackend, StrictCapturer

CPU = torch.device("cpu")
NUM_PAGES = SCRATCH = 24
TABLES = {f"r{i}": [4 * i + j for j in range(4)] for i in range(5)}
PROMPT = {"r0": 5, "r1": 9, "r2": 3, "r3": 7, "r4": 4}


@pytest.fixture(scope="module")
def moe_triton() -> Iterator[ModuleType]:
    """kernels.fused_moe_triton with its kernels interpreted (as tests/kernels/test_fused_moe.py does)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        modules = [
            importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            for name in ("kernels.nvfp4_triton", "kernels.fused_moe_triton")
        ]
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    yield modules[1]
    for module in modules:
        importlib.reload(module)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelConfig]:
    path: Path = make_moe_checkpoint(tmp_path_factory.mktemp("moe-graphs"), num_hidden_layers=2)
    cfg = ModelConfig.from_checkpoint(path)
    return load_model(path, cfg, torch.float32, CPU, 64), cfg


def caches_for(cfg: ModelConfig) -> list[torch.Tensor]:
    return [torch.zeros(NUM_PAGES + 1, 2, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_kv_layers)]


def eager_forward(tiny: tuple[Any, ModelConfig]) -> Callable[[ForwardBatch], torch.Tensor]:
    model, cfg = tiny
    caches = caches_for(cfg)
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        backend.plan(batch)
        return model(batch.input_ids, batch.positions, caches, backend)

    return forward


def strict_runner(tiny: tuple[Any, ModelConfig], sizes: tuple[int, ...]) -> CudaGraphRunner:
    model, cfg = tiny
    attention = GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    return CudaGraphRunner(
        model,
        caches_for(cfg),
        attention,
        DecodeBuckets(sizes),
        SCRATCH,
        4,
        StrictCapturer(exempt=attention.plan_storages),
    )


@torch.inference_mode()
def test_moe_decode_captures_with_no_host_sync_and_replays_any_routing(
    tiny: tuple[Any, ModelConfig], moe_triton: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = eager_forward(tiny)  # the grouped torch reference, outside any graph
    runner = strict_runner(tiny, (2, 4))
    steps = [
        forward_batch(*[(r, 0, n, TABLES[r]) for r, n in PROMPT.items()]),  # prefill: eager in both
        forward_batch(*[(r, PROMPT[r], 1, TABLES[r]) for r in ("r0", "r1", "r2")]),  # bucket 4
        forward_batch(*[(r, PROMPT[r], 1, TABLES[r]) for r in ("r3", "r4")]),  # bucket 2
        forward_batch(*[(r, PROMPT[r] + 1, 1, TABLES[r]) for r in ("r4", "r3", "r1", "r0")]),  # bucket 4 again
    ]
    want = [eager(batch) for batch in steps]
    # The CUDA path's experts: the Triton kernels (interpreted here), as engine/models/moe.py runs them on a GPU.
    monkeypatch.setattr(moe_module, "fused_experts", moe_triton.fused_experts_triton)
    runner.capture()  # the strict capturer fails on any host-syncing op
    replayed = []
    for batch, expected in zip(steps, want):
        replayed.append(runner.graph_size_for(batch))
        torch.testing.assert_close(runner.forward(batch), expected, rtol=2e-2, atol=2e-2)  # fp16 dots
    assert replayed == [None, 4, 2, 4]


@torch.inference_mode()
def test_the_check_catches_the_reference_experts_host_read(tiny: tuple[Any, ModelConfig]) -> None:
    runner = strict_runner(tiny, (2,))
    with pytest.raises(AssertionError, match="host-syncing ops: .*bincount"):
        runner.capture()
