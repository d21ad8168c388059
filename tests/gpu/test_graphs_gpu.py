"""Real CUDA-graph capture for hybrid (Gated DeltaNet) and MoE models and for verify steps
(engine/cuda_graph.py): tiny random models of tests/factories.py, FlashInfer attention and fla-core's
DeltaNet kernels (the torch rule where fla-core is missing), graph steps against the eager forward
with padded batches, and the slots padded rows must not touch. The CPU half of these checks is
tests/engine/test_cuda_graph_hybrid.py and tests/engine/test_moe_graph.py. Skipped without CUDA or FlashInfer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.hybrid_backend import HybridBackend
from engine.attention.hybrid_runner import fla_import_error
from engine.attention.linear_attention import TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.batch import ForwardBatch, build_forward_batch
from engine.cuda_graph import CudaGraphRunner, DecodeBuckets
from engine.weights.config.model_config import ModelConfig
from engine.weights.loader import load_model
from scheduler.output import ScheduledRequest, SchedulerOutput
from tests.factories import make_hybrid_checkpoint, make_moe_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    pytest.importorskip("flashinfer")
    from engine.attention.flashinfer import FlashInferAttentionBackend

CUDA = torch.device("cuda")
BS = 16
NUM_PAGES = 64  # page NUM_PAGES is the scratch page
NUM_SLOTS = 8
K = 3  # drafts per request in a verify step
TOL = dict(rtol=2e-2, atol=2e-2)  # bf16
SHAPE = dict(
    head_dim=64,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
TABLES = {f"r{i}": list(range(8 * i, 8 * i + 8)) for i in range(5)}
PROMPT = {"r0": 5, "r1": 17, "r2": 33, "r3": 16, "r4": 1}
SLOTS = {"r0": 3, "r1": 0, "r2": 7, "r3": 1, "r4": 4}


def batch_of(*reqs: tuple[str, int, int, int]) -> ForwardBatch:
    """(request, start, new tokens, drafts among them)."""
    return build_forward_batch(
        SchedulerOutput(
            tuple(
                ScheduledRequest(
                    r,
                    tuple((7 * p + 3) % 500 for p in range(start, start + n)),
                    start,
                    tuple(TABLES[r]),
                    True,
                    state_slot=SLOTS[r],
                    num_draft_tokens=drafts,
                )
                for r, start, n, drafts in reqs
            ),
            (),
        ),
        BS,
        CUDA,
    )


def caches_for(cfg: ModelConfig) -> list[torch.Tensor]:
    return [
        torch.zeros(NUM_PAGES + 1, 2, BS, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device=CUDA)
        for _ in range(cfg.num_kv_layers)
    ]


def attention(cfg: ModelConfig) -> Any:
    return FlashInferAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BS, torch.bfloat16, CUDA)


def hybrid_backend(cfg: ModelConfig) -> tuple[HybridBackend, StatePool]:
    pool = StatePool(cfg.hybrid, NUM_SLOTS, CUDA)
    if fla_import_error(CUDA) is None:
        from engine.attention.linear_attention_fla import FlaLinearAttentionBackend

        return HybridBackend(attention(cfg), FlaLinearAttentionBackend(pool, CUDA)), pool
    return HybridBackend(attention(cfg), TorchLinearAttentionBackend(pool, CUDA)), pool


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelConfig]:
    path: Path = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid-graphs-gpu"), **SHAPE)
    cfg = ModelConfig.from_checkpoint(path)
    return load_model(path, cfg, torch.bfloat16, CUDA, 128), cfg


@torch.inference_mode()
def test_hybrid_decode_and_verify_graphs_equal_eager(hybrid: tuple[Any, ModelConfig]) -> None:
    model, cfg = hybrid
    backend, pool = hybrid_backend(cfg)
    runner = CudaGraphRunner(
        model, caches_for(cfg), backend, DecodeBuckets((1, 2, 4, 8)), NUM_PAGES, 8, verify_query_len=1 + K
    )
    runner.capture()  # a host sync or a data-dependent shape inside fails the capture
    assert runner.captured_sizes == [1, 2, 4, 8] and runner.captured_verify_sizes == [1, 2, 4, 8]
    assert pool.recurrent[:, :NUM_SLOTS].abs().sum() == 0, "capture touched a request's slot"
    eager_backend, eager_pool = hybrid_backend(cfg)
    eager_caches = caches_for(cfg)
    steps = [
        batch_of(*[(r, 0, n, 0) for r, n in PROMPT.items()]),
        batch_of(*[(r, n, 1, 0) for r, n in PROMPT.items()]),  # bucket 8
        batch_of(*[(r, PROMPT[r] + 1, 1 + K, K) for r in ("r0", "r2", "r4")]),  # verify, bucket 4
        batch_of(*[(r, PROMPT[r] + 2 + K, 1, 0) for r in ("r2", "r0")]),  # bucket 2
    ]
    sizes = []
    for batch in steps:
        sizes.append(runner.graph_size_for(batch))
        got = runner.forward(batch).clone()
        eager_backend.plan(batch)
        want = model(batch.input_ids, batch.positions, eager_caches, eager_backend)
        torch.testing.assert_close(got, want, **TOL)
    assert sizes == [None, 8, 4, 2]
    torch.testing.assert_close(pool.recurrent[:, :NUM_SLOTS], eager_pool.recurrent[:, :NUM_SLOTS], **TOL)
    torch.testing.assert_close(pool.conv[:, :NUM_SLOTS], eager_pool.conv[:, :NUM_SLOTS], **TOL)
    for g, w in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(g[:NUM_PAGES], w[:NUM_PAGES], **TOL)


@torch.inference_mode()
def test_padded_rows_touch_no_other_slot(hybrid: tuple[Any, ModelConfig]) -> None:
    model, cfg = hybrid
    backend, pool = hybrid_backend(cfg)
    runner = CudaGraphRunner(model, caches_for(cfg), backend, DecodeBuckets((8,)), NUM_PAGES, 8)
    runner.capture()
    pool.recurrent.normal_()
    pool.conv.normal_()
    before = pool.recurrent.clone(), pool.conv.clone()
    runner.forward(batch_of(*[(r, PROMPT[r], 1, 0) for r in ("r0", "r2", "r4")]))  # 5 dummies
    real = {SLOTS[r] for r in ("r0", "r2", "r4")}
    for slot in range(NUM_SLOTS):
        same = torch.equal(pool.recurrent[:, slot], before[0][:, slot]) and torch.equal(
            pool.conv[:, slot], before[1][:, slot]
        )
        assert same == (slot not in real), f"slot {slot}"


@torch.inference_mode()
def test_moe_decode_graphs_capture_and_equal_eager(tmp_path: Path) -> None:
    path = make_moe_checkpoint(
        tmp_path / "moe", head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    cfg = ModelConfig.from_checkpoint(path)
    model = load_model(path, cfg, torch.bfloat16, CUDA, 128)
    runner = CudaGraphRunner(model, caches_for(cfg), attention(cfg), DecodeBuckets((1, 4, 8)), NUM_PAGES, 8)
    runner.capture()  # a host sync or a data-dependent shape inside fails the capture
    eager_backend, eager_caches = attention(cfg), caches_for(cfg)
    sizes = []
    for batch in (
        batch_of(*[(r, 0, n, 0) for r, n in PROMPT.items()]),
        batch_of(*[(r, n, 1, 0) for r, n in PROMPT.items()]),
        batch_of(*[(r, PROMPT[r] + 1, 1, 0) for r in ("r3", "r1")]),
    ):
        sizes.append(runner.graph_size_for(batch))
        got = runner.forward(batch).clone()
        eager_backend.plan(batch)
        torch.testing.assert_close(got, model(batch.input_ids, batch.positions, eager_caches, eager_backend), **TOL)
    assert sizes == [None, 8, 4]
