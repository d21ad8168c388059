"""Padding a step to its CUDA-graph bucket (engine/cuda_graph.py): dummy requests over the scratch KV
page (and, for hybrids, the state pool's scratch slot), for pure-decode steps and for verify steps
where every request has the same 1 + k rows."""

from __future__ import annotations

import dataclasses

import torch

from engine.batch import ForwardBatch
from engine.config import EngineConfig

PADDING_REQUEST_ID = ""  # request id of a dummy row; dummy rows are never sampled


def is_pure_decode(batch: ForwardBatch) -> bool:
    return batch.num_requests > 0 and all(n == 1 for n in batch.query_lens)


def uniform_query_len(batch: ForwardBatch) -> int | None:
    """The query rows every request of `batch` has (1: pure decode, 1 + k: a verify step of k
    drafts each), or None when they differ or the batch is empty."""
    if batch.num_requests == 0 or any(n != batch.query_lens[0] for n in batch.query_lens):
        return None
    return batch.query_lens[0]


def pad_decode_batch(
    batch: ForwardBatch, size: int, scratch_page: int, query_len: int = 1, scratch_slot: int | None = None
) -> ForwardBatch:
    """`batch` (pure decode, or a verify step with `query_len` rows per request) with dummy
    requests appended up to `size` requests.

    A dummy request is token 0 at positions 0..query_len-1 with a KV of its own in `scratch_page`:
    it writes K/V only there and attends only to that, so real rows and real pages are untouched.
    For a hybrid (`scratch_slot` given) it holds the state pool's scratch slot, so its DeltaNet
    rows read and write no request's state. Real rows keep their indices, and logits_indices is
    unchanged: dummies are never sampled. All on the batch's device, no host sync."""
    assert batch.num_requests == 0 or uniform_query_len(batch) == query_len, (
        f"only pure-decode batches (or verify steps of {query_len} rows per request) are padded"
    )
    assert query_len <= batch.block_size, f"a dummy's {query_len} rows do not fit the scratch page"
    pad = size - batch.num_requests
    assert pad >= 0, f"{batch.num_requests} requests do not fit a batch of {size}"
    if pad == 0:
        return batch
    dev = batch.input_ids.device
    steps = torch.arange(1, pad + 1, dtype=torch.int32, device=dev)  # [pad]
    rows = torch.arange(query_len, dtype=torch.int64, device=dev).repeat(pad)  # [pad * L]: each dummy's positions

    def extend(t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, tail.to(t.dtype)])

    def fill(value: int, n: int = pad) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.int64, device=dev)

    return dataclasses.replace(
        batch,
        input_ids=extend(batch.input_ids, fill(0, pad * query_len)),
        positions=extend(batch.positions, rows),
        qo_indptr=extend(batch.qo_indptr, steps * query_len + batch.num_tokens),
        kv_indptr=extend(batch.kv_indptr, steps + batch.kv_indices.numel()),
        kv_indices=extend(batch.kv_indices, fill(scratch_page)),
        kv_last_page_len=extend(batch.kv_last_page_len, fill(query_len)),
        slot_mapping=extend(batch.slot_mapping, rows + scratch_page * batch.block_size),
        query_lens=[*batch.query_lens, *[query_len] * pad],
        seq_lens=[*batch.seq_lens, *[query_len] * pad],
        request_ids=[*batch.request_ids, *[PADDING_REQUEST_ID] * pad],
        state_slots=batch.state_slots if scratch_slot is None else (*batch.state_slots, *[scratch_slot] * pad),
    )


def verify_graph_query_len(config: EngineConfig, block_size: int) -> int | None:
    """Rows per request of the verify steps worth a graph: 1 + --num-speculative-tokens with
    speculative decoding on (a step where every request verifies that many drafts), when a dummy
    request's rows fit the scratch page."""
    if config.speculative_method is None or config.num_speculative_tokens < 1:
        return None
    query_len = 1 + config.num_speculative_tokens
    return query_len if query_len <= block_size else None
