"""The GPU path's CPU-checkable half: attention backend selection, decode graph buckets, padding a
decode ForwardBatch over the scratch page, the graph runner's replay/fallback plumbing (capture
stood in for by re-running the captured function), the FlashInfer backend's planning against a
recording stand-in of the flashinfer API, and the offline bundle's trim, kernel plan and manifest."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import subprocess
import sys
import types
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4serve_tools import bundle
from engine.attention.flashinfer import FlashInferAttentionBackend, cache_rows, decode_uses_tensor_cores, \
    host_metadata, prefill_backend_for
from engine.attention.select import choose_backend, flashinfer_import_error, make_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.config import ConfigError, ModelConfig
from engine.cuda_graph import PADDING_REQUEST_ID, CudaGraphRunner, DecodeBuckets, graphs_disabled_reason, \
    pad_decode_batch
from engine.loader import load_model
from scheduler.output import ScheduledRequest, SchedulerOutput

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BS = 4  # tokens per KV page in these tests


def sched(*reqs: tuple[str, int, int, list[int]]) -> SchedulerOutput:
    """(request id, start_pos, num_new_tokens, block table) -> a SchedulerOutput; token ids are
    derived from the position so repeated runs feed the same tokens."""
    return SchedulerOutput(tuple(
        ScheduledRequest(rid, tuple((7 * p + 3) % 500 for p in range(start, start + n)), start, tuple(table), True)
        for rid, start, n, table in reqs), ())


def batch_of(*reqs: tuple[str, int, int, list[int]]) -> ForwardBatch:
    return build_forward_batch(sched(*reqs), BS, CPU)


# ---- backend selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("available", [True, False])
def test_torch_is_used_whenever_asked_for(device: torch.device, available: bool) -> None:
    assert choose_backend("torch", device, available) == "torch"


def test_auto_picks_flashinfer_on_cuda_when_it_imports_and_covers_the_model() -> None:
    assert choose_backend("auto", CUDA, True, dtype=torch.bfloat16, head_dim=128) == "flashinfer"
    assert choose_backend("flashinfer", CUDA, True, dtype=torch.float16, head_dim=64) == "flashinfer"


@pytest.mark.parametrize(("device", "available", "dtype", "head_dim", "reason"), [
    (CPU, True, torch.float32, 16, "needs a CUDA device, this run uses cpu"),
    (CUDA, False, torch.bfloat16, 128, "flashinfer does not import here"),
    (CUDA, True, torch.float32, 128, "does not cover dtype float32"),
    (CUDA, True, torch.bfloat16, 80, "does not cover head_dim 80"),
])
def test_auto_falls_back_to_torch_and_logs_why(device: torch.device, available: bool, dtype: torch.dtype,
                                               head_dim: int, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fp4serve.attention"):
        assert choose_backend("auto", device, available, dtype=dtype, head_dim=head_dim) == "torch"
    [record] = caplog.records
    assert reason in record.getMessage()
    assert record.levelno == (logging.WARNING if device.type == "cuda" else logging.INFO)


@pytest.mark.parametrize(("device", "available", "dtype", "head_dim", "reason"), [
    (CPU, True, None, None, "needs a CUDA device, this run uses cpu"),
    (CUDA, False, None, None, "flashinfer does not import here"),
    (CUDA, True, torch.float32, 128, "does not cover dtype float32"),
])
def test_flashinfer_where_it_cannot_run_is_a_one_line_config_error(
        device: torch.device, available: bool, dtype: torch.dtype | None, head_dim: int | None, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        choose_backend("flashinfer", device, available, dtype=dtype, head_dim=head_dim)
    message = str(e.value)
    assert message.startswith("--attention-backend flashinfer: ") and reason in message and "\n" not in message


def test_an_unknown_backend_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'flash' is not one of auto, flashinfer, torch"):
        choose_backend("flash", CUDA, True)


class _ImportRecorder:
    """A meta-path finder that records top-level imports and lets the next finder resolve them."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        self.names.append(name)


def test_the_import_probe_never_imports_flashinfer_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert flashinfer_import_error(CPU) == "the device is cpu, not CUDA"
    assert "flashinfer" not in recorder.names
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # as if it is not installed
    assert flashinfer_import_error(CUDA).startswith("import flashinfer failed (ModuleNotFoundError")


def test_make_backend_builds_the_torch_reference(qwen3_ckpt: Path) -> None:
    cfg = ModelConfig.from_checkpoint(qwen3_ckpt)
    backend = make_backend("torch", cfg, torch.float32, CPU, BS)
    assert isinstance(backend, TorchAttentionBackend) and backend.num_kv_heads == cfg.num_kv_heads


# ---- buckets and padding ---------------------------------------------------------------------------
@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, (1,)), (3, (1, 2, 3)), (16, (1, 2, 4, 8, 16)), (33, (1, 2, 4, 8, 16, 24, 32, 33)),
    (100, (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)),
    (128, (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)),
])
def test_buckets_step_finely_then_by_16_and_end_at_max_num_seqs(max_num_seqs: int, sizes: tuple[int, ...]) -> None:
    assert DecodeBuckets.up_to(max_num_seqs).sizes == sizes


@pytest.mark.parametrize(("batch_size", "bucket"), [
    (0, None), (1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (33, 48), (64, 64), (65, None)])
def test_a_batch_replays_the_smallest_bucket_that_holds_it(batch_size: int, bucket: int | None) -> None:
    assert DecodeBuckets.up_to(64).bucket_for(batch_size) == bucket


def test_padding_appends_dummy_rows_that_own_only_the_scratch_page() -> None:
    batch = batch_of(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 0, 1, [9]))
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
    batch = batch_of(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]))
    assert pad_decode_batch(batch, 2, scratch_page=40) is batch


def test_only_pure_decode_batches_are_padded() -> None:
    with pytest.raises(AssertionError, match="pure-decode"):
        pad_decode_batch(batch_of(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2])), 4, scratch_page=40)


@pytest.mark.parametrize("reqs", [
    [("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 3, 6, [7, 8, 9])],
    [("a", 7, 1, [1, 2]), ("b", 3, 1, [4])],
    [("a", 0, 16, [1, 2, 3, 4])],
])
def test_host_metadata_equals_the_batch_device_tensors(reqs: list[tuple[str, int, int, list[int]]]) -> None:
    batch = batch_of(*reqs)
    meta = host_metadata(batch)
    assert torch.equal(meta.qo_indptr, batch.qo_indptr)
    assert torch.equal(meta.kv_indptr, batch.kv_indptr)
    assert torch.equal(meta.kv_last_page_len, batch.kv_last_page_len)


def test_cache_rows_address_k_in_the_flat_view_and_v_one_page_later() -> None:
    cache = torch.zeros(6, 2, BS, 1, 1)
    slots = torch.tensor([0, 5, 23])  # (page 0, 0), (1, 1), (5, 3)
    rows = cache_rows(slots, BS)
    flat = cache.view(-1, 1, 1)
    flat[rows] = 1.0
    flat[rows + BS] = 2.0
    assert cache[0, 0, 0].item() == 1 and cache[1, 0, 1].item() == 1 and cache[5, 0, 3].item() == 1
    assert cache[0, 1, 0].item() == 2 and cache[1, 1, 1].item() == 2 and cache[5, 1, 3].item() == 2
    assert cache.sum().item() == 9


# ---- the graph runner, with capture stood in for ---------------------------------------------------------
class _GraphableTorchBackend(TorchAttentionBackend):
    """The torch reference with the graph hooks: on CPU a "replay" re-runs the forward, which then
    reads whatever plan_graph() and the runner's input buffers hold."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.prepared: tuple[tuple[int, ...], int] | None = None
        self.graph_plans: list[int] = []

    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        self.prepared = (tuple(batch_sizes), max_num_pages)

    def plan_graph(self, batch: ForwardBatch) -> None:
        self.graph_plans.append(batch.num_requests)
        self.plan(batch)


class _ReplayByRerun:
    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn().clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())


class _FakeCapturer:
    def __init__(self) -> None:
        self.graphs: list[_ReplayByRerun] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> _ReplayByRerun:
        self.graphs.append(_ReplayByRerun(fn))
        return self.graphs[-1]


NUM_PAGES, SCRATCH = 24, 24  # the scheduler's pages 0..23, the scratch page one past them
TABLES = {f"r{i}": [4 * i + j for j in range(4)] for i in range(5)}  # 16 tokens each
PROMPT = {"r0": 5, "r1": 9, "r2": 3, "r3": 12, "r4": 4}


@pytest.fixture(scope="module")
def tiny(qwen3_ckpt: Path) -> tuple[Any, ModelConfig]:
    cfg = ModelConfig.from_checkpoint(qwen3_ckpt)
    return load_model(qwen3_ckpt, cfg, torch.float32, CPU, 64), cfg


def _runner(tiny: tuple[Any, ModelConfig], sizes: tuple[int, ...]) -> tuple[CudaGraphRunner, _FakeCapturer]:
    model, cfg = tiny
    caches = [torch.zeros(NUM_PAGES + 1, 2, BS, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    backend = _GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    capturer = _FakeCapturer()
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
        batch = batch_of(*reqs)
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
    decode3 = batch_of(*[(r, PROMPT[r], 1, TABLES[r]) for r in ("r0", "r1", "r2")])
    assert runner.graph_size_for(batch_of(("r0", PROMPT["r0"], 1, TABLES["r0"]))) is None  # not captured yet
    runner.capture()
    assert runner.graph_size_for(decode3) is None  # above the largest bucket
    assert runner.graph_size_for(batch_of(("r0", 0, 5, TABLES["r0"]), ("r1", 9, 1, TABLES["r1"]))) is None
    assert runner.graph_size_for(batch_of(("r0", PROMPT["r0"], 1, TABLES["r0"]))) == 1
    runner.forward(decode3)
    assert [g.replays for g in capturer.graphs] == [0, 0]


def test_graphs_are_off_with_enforce_eager_on_cpu_or_with_the_torch_backend(tiny: Any) -> None:
    _, cfg = tiny
    torch_backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    graphable = _GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    assert graphs_disabled_reason(True, CUDA, graphable) == "--enforce-eager"
    assert graphs_disabled_reason(False, CPU, graphable) == "the device is cpu, not CUDA"
    assert "torch attention backend plans on the host" in str(graphs_disabled_reason(False, CUDA, torch_backend))
    assert graphs_disabled_reason(False, CUDA, graphable) is None


# ---- the FlashInfer backend against a recording stand-in of flashinfer's API ---------------------------
class _Wrapper:
    """Records what fp4serve passes to a FlashInfer wrapper; run() checks the new K/V are in
    the cache before attention reads it, and returns zeros."""

    def __init__(self, kind: str, log: list[tuple[Any, ...]], workspace: torch.Tensor, layout: str, **kwargs: Any) -> None:
        self.kind, self.log, self.layout, self.kwargs = kind, log, layout, kwargs
        log.append(("init", kind, kwargs))
        self.expect_in_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.log.append(("plan", self.kind, args, kwargs))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        self.log.append(("run", self.kind, tuple(q.shape)))
        return torch.zeros_like(q)


def _fake_flashinfer(log: list[tuple[Any, ...]]) -> types.ModuleType:
    api = types.ModuleType("flashinfer")
    api.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: _Wrapper("prefill", log, *a, **k)  # type: ignore[attr-defined]
    api.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: _Wrapper("decode", log, *a, **k)  # type: ignore[attr-defined]
    return api


def _flashinfer_backend(log: list[tuple[Any, ...]], heads: tuple[int, int] = (4, 2)) -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend(*heads, 16, BS, torch.bfloat16, CPU, capability=(9, 0), workspace_bytes=1024,
                                      api=_fake_flashinfer(log))


def _plans(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [entry for entry in log if entry[0] == "plan"]


@pytest.mark.parametrize(("heads", "capability", "head_dim", "tensor_cores", "prefill"), [
    ((32, 8), (9, 0), 128, False, "fa3"), ((64, 8), (9, 0), 128, True, "fa3"), ((16, 16), (9, 0), 96, False, "fa2"),
    ((32, 8), (8, 0), 128, False, "fa2"), ((32, 8), (10, 0), 64, False, "fa2"),
])
def test_kernel_families_follow_gqa_group_and_device(heads: tuple[int, int], capability: tuple[int, int],
                                                     head_dim: int, tensor_cores: bool, prefill: str) -> None:
    assert decode_uses_tensor_cores(*heads) is tensor_cores
    assert prefill_backend_for(capability, head_dim) == prefill


def test_wrappers_are_built_once_with_pinned_kernel_families() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log, heads=(40, 8))
    assert [(e[1], e[2]) for e in log] == [
        ("prefill", {"backend": "fa2"}),  # head_dim 16: fa3 has no kernel for it
        ("decode", {"use_cuda_graph": False, "use_tensor_cores": True, "backend": "fa2"}),
    ]
    assert backend.name == "flashinfer"


def test_pure_decode_plans_the_decode_wrapper_from_host_metadata() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    batch = batch_of(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]))
    backend.plan(batch)
    [(_, kind, args, kwargs)] = _plans(log)
    assert kind == "decode"
    indptr, indices, last, *shape = args
    assert indptr.device == CPU and last.device == CPU  # planning never waits on the device
    assert indptr.tolist() == [0, 2, 5] and indices is batch.kv_indices and last.tolist() == [1, 1]
    assert shape == [4, 2, 16, BS]
    assert kwargs == {"q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}


def test_a_mixed_batch_plans_the_causal_prefill_wrapper_with_ragged_queries() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    batch = batch_of(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 2, 3, [7, 9]))
    backend.plan(batch)
    [(_, kind, args, kwargs)] = _plans(log)
    assert kind == "prefill"
    qo, kv, indices, last, *shape = args
    assert qo.tolist() == [0, 5, 6, 9] and kv.tolist() == [0, 2, 5, 7] and last.tolist() == [1, 1, 1]
    assert indices is batch.kv_indices and shape == [4, 2, 16, BS] and kwargs["causal"] is True


def test_forward_writes_every_new_kv_into_its_slot_then_attends() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    batch = batch_of(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]))
    backend.plan(batch)
    cache = torch.zeros(6, 2, BS, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(6, 2, 16).bfloat16()
    v = torch.randn(6, 2, 16).bfloat16()
    out = backend.forward(torch.randn(6, 4, 16).bfloat16(), k, v, cache)
    assert out.shape == (6, 4, 16) and log[-1] == ("run", "prefill", (6, 4, 16))
    for row, (page, offset) in enumerate([(3, 0), (3, 1), (3, 2), (3, 3), (5, 0), (2, 0)]):
        assert torch.equal(cache[page, 0, offset], k[row]) and torch.equal(cache[page, 1, offset], v[row])
    assert (cache != 0).any(dim=(-1, -2)).sum().item() == 12  # nothing else written


def test_graph_wrappers_share_fixed_buffers_and_plan_graph_fills_them() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    backend.prepare_graphs([1, 2, 4], max_num_pages=12)
    graph_inits = [e[2] for e in log if e[0] == "init" and e[2].get("use_cuda_graph")]
    assert len(graph_inits) == 3
    indices = {kw["paged_kv_indices_buffer"].data_ptr() for kw in graph_inits}
    indptr = {kw["paged_kv_indptr_buffer"].data_ptr() for kw in graph_inits}
    assert len(indices) == 1 and len(indptr) == 1  # one set of buffers, viewed per size
    assert [kw["paged_kv_indptr_buffer"].numel() for kw in graph_inits] == [2, 3, 5]
    assert [kw["paged_kv_last_page_len_buffer"].numel() for kw in graph_inits] == [1, 2, 4]
    assert graph_inits[0]["paged_kv_indices_buffer"].numel() == 12

    padded = pad_decode_batch(batch_of(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2])), 4, scratch_page=9)
    backend.plan_graph(padded)
    [(_, _, args, _)] = _plans(log)
    assert args[0].tolist() == [0, 2, 5, 6, 7] and args[2].tolist() == [1, 1, 1, 1]
    rows = cache_rows(padded.slot_mapping, BS)
    assert torch.equal(backend._k_rows, rows) and torch.equal(backend._v_rows, rows + BS)
    assert backend._k_rows.data_ptr() == backend._graph_k_rows.data_ptr()  # the captured address
    with pytest.raises(AssertionError, match="no graph wrapper for batch size 3"):
        backend.plan_graph(pad_decode_batch(batch_of(("a", 4, 1, [3, 5])), 3, scratch_page=9))


# ---- the offline bundle --------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "kept"), [
    ("flashinfer/decode.py", True), ("flashinfer/experimental/x/y.py", True),
    ("flashinfer_python-0.7.2.post1.dist-info/METADATA", True), ("flashinfer/data/build_backend.py", True),
    ("flashinfer/data/csrc/batch_decode.cu", True), ("flashinfer/data/csrc/batch_prefill_sm90.jinja", True),
    ("flashinfer/data/csrc/fused_moe/x.cu", False), ("flashinfer/data/csrc/nv_internal/a/b.h", False),
    ("flashinfer/data/include/flashinfer/page.cuh", True), ("flashinfer/data/cutlass/include/cute/x.hpp", True),
    ("flashinfer/data/cutlass/tools/util/include/cutlass/util/a.h", True),
    ("flashinfer/data/cutlass/examples/a.cu", False), ("flashinfer/data/cutlass/python/a.py", False),
    ("flashinfer/data/cccl/cub/cub/a.cuh", True), ("flashinfer/data/cccl/libcudacxx/include/cuda/std/a", True),
    ("flashinfer/data/cccl/thrust/thrust/a.h", True), ("flashinfer/data/cccl/python/a.py", False),
    ("flashinfer/data/spdlog/include/spdlog/a.h", True), ("flashinfer/data/aot/m/m.so", True),
])
def test_trim_keeps_python_headers_and_top_level_sources(path: str, kept: bool) -> None:
    assert bundle.keep_in_wheel(path) is kept


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes] | None = None) -> Path:
    """A minimal valid py3-none-any wheel."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    entries = {**(files or {}),
               f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
               f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in [*entries, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


FAKE_FLASHINFER = {"flashinfer/__init__.py": b"__version__ = '0.7.2.post1'\n",
                   "flashinfer/data/csrc/batch_decode.cu": b"// decode\n",
                   "flashinfer/data/csrc/fused_moe/big.cu": b"x" * 5000,
                   "flashinfer/data/include/flashinfer/page.cuh": b"// page\n",
                   "flashinfer/data/cutlass/examples/e.cu": b"y" * 300}


def test_trimmed_wheel_has_a_record_of_exactly_its_files(tmp_path: Path) -> None:
    src = make_wheel(tmp_path, "flashinfer-python", "0.7.2.post1", FAKE_FLASHINFER)
    (tmp_path / "out").mkdir()
    so = b"\x7fELF prebuilt"
    report = bundle.trim_wheel(src, tmp_path / "out" / src.name, {bundle.aot_name("mod"): so})
    assert (report.dropped_files, report.dropped_bytes) == (2, 5300)
    with zipfile.ZipFile(tmp_path / "out" / src.name) as z:
        names = set(z.namelist())
        record = z.read("flashinfer_python-0.7.2.post1.dist-info/RECORD").decode().splitlines()
        files = {n: z.read(n) for n in names}
    assert "flashinfer/data/csrc/fused_moe/big.cu" not in names and "flashinfer/data/aot/mod/mod.so" in names
    assert report.kept_files == len(names) - 1 == 6
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()  # noqa: E731
    want = {f"{n},sha256={digest(d)},{len(d)}" for n, d in files.items() if not n.endswith("RECORD")}
    assert set(record) == want | {"flashinfer_python-0.7.2.post1.dist-info/RECORD,,"}


def test_kernel_module_names_are_flashinfers() -> None:
    common = "dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128_head_dim_vo_128_posenc_0_" \
             "use_swa_False_use_logits_cap_False"
    assert bundle.KernelSpec("decode", "fa2", "bfloat16", 128).module == f"batch_decode_with_kv_cache_{common}"
    assert bundle.KernelSpec("prefill", "fa3", "bfloat16", 128).module == \
        f"batch_prefill_with_kv_cache_{common}_f16qk_False_sm90"
    assert bundle.KernelSpec("prefill", "fa2", "bfloat16", 128).module == \
        f"batch_prefill_with_kv_cache_{common}_f16qk_False_kv_stride_equal"
    assert "dtype_q_f16_" in bundle.KernelSpec("decode", "fa2", "float16", 64).module


def test_the_kernel_plan_is_what_the_backend_loads_for_each_shape() -> None:
    qwen = bundle.DEFAULT_SHAPE
    llama70 = bundle.ModelShape("l70", 64, 8, 128, "bfloat16")  # group 8: tensor-core decode
    small = bundle.ModelShape("s", 16, 8, 64, "float16")
    K = bundle.KernelSpec
    assert bundle.plan_kernels([qwen, llama70, small, qwen], "sm_90a") == [
        K("decode", "fa2", "bfloat16", 128), K("prefill", "fa3", "bfloat16", 128), K("prefill", "fa2", "bfloat16", 128),
        K("decode", "fa2", "float16", 64), K("prefill", "fa3", "float16", 64)]
    assert bundle.plan_kernels([qwen], "sm_100a") == [K("decode", "fa2", "bfloat16", 128),
                                                      K("prefill", "fa2", "bfloat16", 128)]


@pytest.mark.parametrize(("arch", "parsed"), [("sm_90a", ((9, 0), "9.0a")), ("sm_100a", ((10, 0), "10.0a")),
                                              ("sm_80", ((8, 0), "8.0")), ("sm_120f", ((12, 0), "12.0f"))])
def test_arch_names_map_to_capability_and_flashinfer_arch_list(arch: str, parsed: tuple[Any, str]) -> None:
    assert bundle.parse_arch(arch) == parsed


def test_a_bad_arch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--arch: 'hopper'"):
        bundle.parse_arch("hopper")


def _config_json(folder: Path, **fields: Any) -> Path:
    folder.mkdir()
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, **fields}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_model_shape_reads_heads_and_the_gpu_dtype(tmp_path: Path) -> None:
    path = _config_json(tmp_path / "m", head_dim=128, torch_dtype="float16")
    assert bundle.model_shape(path) == bundle.ModelShape("m", 4, 2, 128, "float16")
    assert bundle.model_shape(_config_json(tmp_path / "b", torch_dtype="float32")).dtype == "bfloat16"


def test_a_model_flashinfer_does_not_cover_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not cover head_dim 16"):
        bundle.model_shape(_config_json(tmp_path / "tiny", head_dim=16))


def test_pip_downloads_cp312_manylinux_binaries(tmp_path: Path) -> None:
    cmd = bundle.pip_download_command(["ninja"], tmp_path, no_deps=True)
    assert cmd == [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "--dest", str(tmp_path),
                   "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                   "--platform", "manylinux_2_28_x86_64", "--no-deps", "ninja"]


def test_bundle_end_to_end_from_a_local_wheel_folder(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "flashinfer-python", "0.7.2.post1", FAKE_FLASHINFER)
    for name, version in [("apache-tvm-ffi", "0.1.15"), ("nvidia-ml-py", "13.0"), ("ninja", "1.13"),
                          ("requests", "2.34"), ("tqdm", "4.70"), ("packaging", "26.0")]:
        make_wheel(links, name, version)
    out = tmp_path / "bundle"
    assert bundle.main(["--out", str(out), "--no-build", "--find-links", str(links)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(w["name"] for w in manifest["wheels"]) == [
        "apache-tvm-ffi", "flashinfer-python", "ninja", "nvidia-ml-py", "packaging", "requests", "tqdm"]
    assert manifest["flashinfer"]["dropped_files"] == 2
    assert [(k["kind"], k["backend"], k["prebuilt"]) for k in manifest["kernels"]] == [
        ("decode", "fa2", False), ("prefill", "fa3", False)]
    script = (out / "install.sh").read_text()
    assert "--no-deps apache-tvm-ffi==0.1.15\n" in script
    assert "--no-deps ninja nvidia-ml-py packaging requests tqdm\n" in script
    assert subprocess.run(["bash", "-n", str(out / "install.sh")]).returncode == 0
    with zipfile.ZipFile(out / "wheels" / "flashinfer_python-0.7.2.post1-py3-none-any.whl") as z:
        assert "flashinfer/data/csrc/batch_decode.cu" in z.namelist()
        assert "flashinfer/data/csrc/fused_moe/big.cu" not in z.namelist()


def test_the_bundle_command_parses_its_documented_flags() -> None:
    parser = argparse.ArgumentParser()
    bundle.add_arguments(parser)
    args = parser.parse_args(["--out", "d", "--model", "a", "b", "--arch", "sm_100a", "--no-build"])
    assert (args.out, args.model, args.arch, args.no_build) == (Path("d"), [Path("a"), Path("b")], "sm_100a", True)
