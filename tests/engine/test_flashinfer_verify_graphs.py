"""FlashInfer's verify-step CUDA-graph wrappers (engine/attention/flashinfer.py
`prepare_verify_graphs`, `plan_graph` for steps of 1 + k rows per request), planned against the
recording stand-in of flashinfer's API in tests/engine/test_flashinfer_backend.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.flashinfer import cache_rows
from engine.cuda_graph import pad_decode_batch
from tests.engine.test_flashinfer_backend import BS, _flashinfer_backend, _plans
from tests.factories import forward_batch


def test_verify_graph_wrappers_are_causal_prefills_over_fixed_buffers() -> None:
    log: list[tuple[Any, ...]] = []
    backend = _flashinfer_backend(log)
    backend.prepare_graphs([1, 2, 4], max_num_pages=12)
    backend.prepare_verify_graphs([1, 2, 4], query_len=3, max_num_pages=12)
    verify_inits = [e[2] for e in log if e[0] == "init" and e[1] == "prefill" and e[2].get("use_cuda_graph")]
    assert len(verify_inits) == 3 and all(kw["backend"] == backend.prefill_backend for kw in verify_inits)
    assert len({kw["qo_indptr_buf"].data_ptr() for kw in verify_inits}) == 1  # one set of buffers, viewed per size
    assert [kw["qo_indptr_buf"].numel() for kw in verify_inits] == [2, 3, 5]
    assert [kw["paged_kv_last_page_len_buf"].numel() for kw in verify_inits] == [1, 2, 4]

    # two requests verifying 2 drafts each, padded to 4: the dummies own only scratch page 9
    batch = forward_batch(("a", 4, 3, [3, 5]), ("b", 8, 3, [0, 1, 2]))
    padded = pad_decode_batch(batch, 4, scratch_page=9, query_len=3)
    backend.plan_graph(padded)
    [(_, kind, args, kwargs)] = _plans(log)
    qo, kv, indices, last, *shape = args
    assert kind == "prefill" and kwargs["causal"] is True and shape == [4, 2, 16, BS]
    assert qo.tolist() == [0, 3, 6, 9, 12] and kv.tolist() == [0, 2, 5, 6, 7] and last.tolist() == [3, 3, 3, 3]
    assert indices.tolist() == [3, 5, 0, 1, 2, 9, 9]
    rows = cache_rows(padded.slot_mapping, BS)
    assert torch.equal(backend._k_rows, rows) and backend._k_rows.data_ptr() == backend._verify_k_rows.data_ptr()
    backend.forward(
        torch.zeros(12, 4, 16).bfloat16(),
        torch.zeros(12, 2, 16).bfloat16(),
        torch.zeros(12, 2, 16).bfloat16(),
        torch.zeros(10, 2, BS, 2, 16, dtype=torch.bfloat16),
    )
    assert log[-1] == ("run", "prefill", (12, 4, 16))
    with pytest.raises(AssertionError, match="no verify graph wrapper for 4 x 2 rows"):
        backend.plan_graph(pad_decode_batch(forward_batch(("a", 4, 2, [3, 5])), 4, scratch_page=9, query_len=2))
