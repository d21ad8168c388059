"""The FlashInfer attention backend (engine/attention/flashinfer.py), the CPU-checkable half: host
metadata equal to the batch's device tensors, cache rows, the kernel families, and planning against
a recording stand-in of flashinfer's API."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from engine.attention.flashinfer import (
    FlashInferAttentionBackend,
    cache_rows,
    decode_uses_tensor_cores,
    host_metadata,
    prefill_backend_for,
)
from engine.cuda_graph import pad_decode_batch
from tests.factories import forward_batch

CPU = torch.device("cpu")
BS = 4  # tokens per KV page in these tests (forward_batch's default)


@pytest.mark.parametrize(
    "reqs",
    [
        [("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 3, 6, [7, 8, 9])],
        [("a", 7, 1, [1, 2]), ("b", 3, 1, [4])],
        [("a", 0, 16, [1, 2, 3, 4])],
    ],
)
def test_host_metadata_equals_the_batch_device_tensors(reqs: list[tuple[str, int, int, list[int]]]) -> None:
    batch = forward_batch(*reqs)
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


# ---- the FlashInfer backend against a recording stand-in of flashinfer's API ---------------------------
class _Wrapper:
    """Records what fp4serve passes to a FlashInfer wrapper; run() checks the new K/V are in
    the cache before attention reads it, and returns zeros."""

    def __init__(
        self, kind: str, log: list[tuple[Any, ...]], workspace: torch.Tensor, layout: str, **kwargs: Any
    ) -> None:
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
    return FlashInferAttentionBackend(
        *heads, 16, BS, torch.bfloat16, CPU, capability=(9, 0), workspace_bytes=1024, api=_fake_flashinfer(log)
    )


def _plans(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [entry for entry in log if entry[0] == "plan"]


@pytest.mark.parametrize(
    ("heads", "capability", "head_dim", "tensor_cores", "prefill"),
    [
        ((32, 8), (9, 0), 128, False, "fa3"),
        ((64, 8), (9, 0), 128, True, "fa3"),
        ((16, 16), (9, 0), 96, False, "fa2"),
        ((32, 8), (8, 0), 128, False, "fa2"),
        ((32, 8), (10, 0), 64, False, "fa2"),
    ],
)
def test_kernel_families_follow_gqa_group_and_device(
    heads: tuple[int, int], capability: tuple[int, int], head_dim: int, tensor_cores: bool, prefill: str
) -> None:
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
    batch = forward_batch(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2]))
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
    batch = forward_batch(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]), ("c", 2, 3, [7, 9]))
    backend.plan(batch)
    [(_, kind, args, kwargs)] = _plans(log)
    assert kind == "prefill"
    qo, kv, indices, last, *shape = args
    assert qo.tolist() == [0, 5, 6, 9] and kv.tolist() == [0, 2, 5, 7] and last.tolist() == [1, 1, 1]
    assert indices is batch.kv_indices and shape == [4, 2, 16, BS] and kwargs["causal"] is True


def test_forward_writes_every_new_kv_into_its_slot_then_attends() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    batch = forward_batch(("a", 0, 5, [3, 5]), ("b", 8, 1, [0, 1, 2]))
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

    padded = pad_decode_batch(forward_batch(("a", 4, 1, [3, 5]), ("b", 8, 1, [0, 1, 2])), 4, scratch_page=9)
    backend.plan_graph(padded)
    [(_, _, args, _)] = _plans(log)
    assert args[0].tolist() == [0, 2, 5, 6, 7] and args[2].tolist() == [1, 1, 1, 1]
    rows = cache_rows(padded.slot_mapping, BS)
    assert torch.equal(backend._k_rows, rows) and torch.equal(backend._v_rows, rows + BS)
    assert backend._k_rows.data_ptr() == backend._graph_k_rows.data_ptr()  # the captured address
    with pytest.raises(AssertionError, match="no graph wrapper for batch size 3"):
        backend.plan_graph(pad_decode_batch(forward_batch(("a", 4, 1, [3, 5])), 3, scratch_page=9))
