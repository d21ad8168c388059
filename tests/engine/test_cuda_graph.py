"""CUDA-graph decode (engine/cuda_graph.py), the CPU-checkable half: decode graph buckets, padding
a decode ForwardBatch over the scratch page, and the graph runner's replay/fallback plumbing (capture
stood in for by re-running the captured function)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch
from engine.cuda_graph import (
    PADDING_REQUEST_ID,
    CudaGraphRunner,
    DecodeBuckets,
    graphs_disabled_reason,
    pad_decode_batch,
)
from engine.weights.config.model_config import ModelConfig
from engine.weights.loader import load_model
from tests.factories import forward_batch
from tests.graph_fakes import FakeCapturer, GraphableTorchBackend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BS = 4  # tokens per KV page in these tests (forward_batch's default)


# ---- buckets and padding ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, (1,)),
        (3, (1, 2, 3)),
        (16, (1, 2, 4, 8, 16)),
        (33, (1, 2, 4, 8, 16, 24, 32, 33)),
        (100, (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)),
        (128, (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)),
    ],
)
def test_buckets_step_finely_then_by_16_and_end_at_max_num_seqs(max_num_seqs: int, sizes: tuple[int, ...]) -> None:
    assert DecodeBuckets.up_to(max_num_seqs).sizes == sizes


@pytest.mark.parametrize(
    ("batch_size", "bucket"), [(0, None), (1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (33, 48), (64, 64), (65, None)]
)
def test_a_batch_replays_the_smallest_bucket_that_holds_it(batch_size: int, bucket: int | None) -> None:
    assert DecodeBuckets.up_to(64).bucket_for(batch_size) == bucket


def test_padding_appends_dummy_rows_that_own_only_the_scratch_page() -> None:
    batch = forward_batch(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 0, 1, [9]))
    padded = pad_decode_batch(batch, 6, scratch_page=40)
    i32, i64 = torch.int32, torch.int64
    assert padded.input_ids.tolist() == [*batch.input_ids.tolist(), 0, 0, 0]
    assert torch.equal(padded.positions, torch.tensor([4, 8, 0, 0, 0, 0], dtype=i64))
    assert torch.equal(padded.qo_indptr, torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=i32))
    assert torch.equal(padded.kv_indptr, torch.tensor([0, 2, 5, 6, 7, 8, 9], dtype=i32))
    assert torch.equal(padded.kv_indices, torch.tensor([3, 5, 0, 1, 2, 9, 40, 40, 40], dtype=i32))
    assert torch.equal(padded.kv_last_page_len, torch.tensor([1, 1, 1, 1, 1, 1], dtype=i32))
    assert torch.equal(padded.slot_mapping, torch.tensor([20, 8, 36, 160, 160, 160], dtype=i64))
    assert torch.equal(padded.logits_indices, torch.tensor([0, 1, 2], dtype=i64))  # dummies never sampled
    assert padded.query_lens == [1] * 6 and padded.seq_lens == [5, 9, 1, 1, 1, 1]
    assert padded.request_ids == ["a", "b", "c", *[PADDING_REQUEST_ID] * 3]
    assert padded.sample_request_ids == ["a", "b", "c"]


def test_padding_a_full_bucket_is_the_batch_itself() -> None:
    batch = forward_batch(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]))
    assert pad_decode_batch(batch, 2, scratch_page=40) is batch


def test_only_pure_decode_batches_are_padded() -> None:
    with pytest.raises(AssertionError, match="pure-decode"):
        pad_decode_batch(forward_batch(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2])), 4, scratch_page=40)


# ---- the graph runner, with capture stood in for ---------------------------------------------------------
NUM_PAGES, SCRATCH = 24, 24  # the scheduler's pages 0..23, the scratch page one past them
TABLES = {f"r{i}": [4 * i + j for j in range(4)] for i in range(5)}  # 16 tokens each
PROMPT = {"r0": 5, "r1": 9, "r2": 3, "r3": 12, "r4": 4}


@pytest.fixture(scope="module")
def tiny(qwen3_ckpt: Path) -> tuple[Any, ModelConfig]:
    cfg = ModelConfig.from_checkpoint(qwen3_ckpt)
    return load_model(qwen3_ckpt, cfg, torch.float32, CPU, 64), cfg


def _runner(tiny: tuple[Any, ModelConfig], sizes: tuple[int, ...]) -> tuple[CudaGraphRunner, FakeCapturer]:
    model, cfg = tiny
    caches = [torch.zeros(NUM_PAGES + 1, 2, BS, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    backend = GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    capturer = FakeCapturer()
    return CudaGraphRunner(model, caches, backend, DecodeBuckets(sizes), SCRATCH, 4, capturer), capturer


def _eager(tiny: tuple[Any, ModelConfig]) -> tuple[Callable[[ForwardBatch], torch.Tensor], list[torch.Tensor]]:
    model, cfg = tiny
    caches = [torch.zeros(NUM_PAGES + 1, 2, BS, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        backend.plan(batch)
        return model(batch.input_ids, batch.positions, caches, backend)

    return forward, caches


def test_capture_covers_every_bucket_largest_first_and_touches_only_the_scratch_page(tiny: Any) -> None:
    runner, capturer = _runner(tiny, (1, 2, 4, 8))
    with torch.inference_mode():
        runner.capture()
    assert runner.backend.prepared == ((1, 2, 4, 8), 8 * 4)
    assert runner.backend.graph_plans == [8, 4, 2, 1]
    assert [g.output.shape[0] for g in capturer.graphs] == [8, 4, 2, 1]
    for cache in runner.kv_caches:
        assert cache[:NUM_PAGES].abs().sum() == 0, "dummy rows wrote into a request's page"
        assert cache[SCRATCH, :, 0].abs().sum() > 0 and cache[SCRATCH, :, 1:].abs().sum() == 0


@torch.inference_mode()
def test_graph_decode_equals_eager_and_leaves_real_pages_as_eager_does(tiny: Any) -> None:
    runner, capturer = _runner(tiny, (1, 2, 4, 8))
    runner.capture()
    eager, eager_caches = _eager(tiny)
    steps = [
        [(r, 0, n, TABLES[r]) for r, n in PROMPT.items()],  # prefill: eager in both
        [(r, n, 1, TABLES[r]) for r, n in PROMPT.items()],  # 5 decodes: bucket 8, 3 dummies
        [(r, PROMPT[r] + 1, 1, TABLES[r]) for r in ("r0", "r2", "r4")],  # bucket 4
        [(r, PROMPT[r] + 2, 1, TABLES[r]) for r in ("r1", "r3")],  # bucket 2, no padding
    ]
    replayed = []
    for reqs in steps:
        batch = forward_batch(*reqs)
        replayed.append(runner.graph_size_for(batch))
        got = runner.forward(batch)
        assert got.shape[0] == batch.num_tokens
        torch.testing.assert_close(got, eager(batch), rtol=1e-5, atol=1e-5)
    assert replayed == [None, 8, 4, 2]
    assert [g.replays for g in capturer.graphs] == [1, 1, 1, 0]  # sizes 8, 4, 2, 1
    for got, want in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(got[:NUM_PAGES], want[:NUM_PAGES], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_mixed_oversized_and_precapture_batches_run_eagerly(tiny: Any) -> None:
    runner, capturer = _runner(tiny, (1, 2))
    decode3 = forward_batch(*[(r, PROMPT[r], 1, TABLES[r]) for r in ("r0", "r1", "r2")])
    assert runner.graph_size_for(forward_batch(("r0", PROMPT["r0"], 1, TABLES["r0"]))) is None  # not captured yet
    runner.capture()
    assert runner.graph_size_for(decode3) is None  # above the largest bucket
    assert runner.graph_size_for(forward_batch(("r0", 0, 5, TABLES["r0"]), ("r1", 9, 1, TABLES["r1"]))) is None
    assert runner.graph_size_for(forward_batch(("r0", PROMPT["r0"], 1, TABLES["r0"]))) == 1
    runner.forward(decode3)
    assert [g.replays for g in capturer.graphs] == [0, 0]


def test_graphs_are_off_with_enforce_eager_on_cpu_or_with_the_torch_backend(tiny: Any) -> None:
    _, cfg = tiny
    torch_backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    graphable = GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    assert graphs_disabled_reason(True, CUDA, graphable) == "--enforce-eager"
    assert graphs_disabled_reason(False, CPU, graphable) == "the device is cpu, not CUDA"
    assert "torch attention backend plans on the host" in str(graphs_disabled_reason(False, CUDA, torch_backend))
    assert graphs_disabled_reason(False, CUDA, graphable) is None
