"""`ForwardBatch`: the tensors of one step, built from a `SchedulerOutput` by a pure function.

The flattened batch mixes prefill chunks and decodes. Attention metadata is FlashInfer's
(ragged qo_indptr, paged kv_indptr / kv_indices / kv_last_page_len) and every backend,
the torch reference included, consumes exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [B+1] int32: request i's query rows are qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [B+1] int32: request i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [num_pages_in_batch] int32
    kv_last_page_len: torch.Tensor  # [B] int32, in 1..block_size
    slot_mapping: torch.Tensor  # [T] int64: page * block_size + offset where each new K/V goes
    logits_indices: torch.Tensor  # [S] int64: rows whose hidden states are sampled (1 + drafts per request)
    # Host-side copies (plain lists) for planning without a device sync.
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    request_ids: list[str]
    sample_request_ids: list[str]  # the requests of logits_indices, in order
    # Hybrid models: each request's recurrent-state slot (host side; the linear-attention backend
    # plans from it). Empty for models without recurrent state.
    state_slots: tuple[int, ...] = ()
    # Hybrid prefix caching: states to keep part way through a request's rows this step, as
    # (request index, rows of it done, checkpoint id); those at a request's last row are copied
    # from its slot after the forward instead (the model runner).
    interior_saves: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)


def build_forward_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qo_indptr = [0]
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    logits_indices: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    request_ids: list[str] = []
    sample_ids: list[str] = []
    state_slots: list[int] = []
    interior_saves: list[tuple[int, int, int]] = []
    for index, r in enumerate(out.requests):
        n = r.num_new_tokens
        seq_len = r.seq_len
        num_pages = -(-seq_len // block_size)
        assert len(r.block_table) >= num_pages, f"{r.request_id}: {len(r.block_table)} pages for {seq_len} tokens"
        input_ids.extend(r.token_ids)
        positions.extend(range(r.start_pos, seq_len))
        table = r.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(r.start_pos, seq_len))
        qo_indptr.append(qo_indptr[-1] + n)
        kv_indices.extend(table[:num_pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(seq_len - (num_pages - 1) * block_size)
        query_lens.append(n)
        seq_lens.append(seq_len)
        request_ids.append(r.request_id)
        if r.state_slot is not None:
            state_slots.append(r.state_slot)
        interior_saves.extend(
            (index, s.num_tokens - r.start_pos, s.checkpoint_id) for s in r.checkpoint_saves if s.num_tokens < seq_len
        )
        if r.sample:  # the last row, and with drafts the row before each draft too
            logits_indices.extend(range(qo_indptr[-1] - 1 - r.num_draft_tokens, qo_indptr[-1]))
            sample_ids.append(r.request_id)

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        qo_indptr=t(qo_indptr, torch.int32),
        kv_indptr=t(kv_indptr, torch.int32),
        kv_indices=t(kv_indices, torch.int32),
        kv_last_page_len=t(last_page_len, torch.int32),
        slot_mapping=t(slots, torch.int64),
        logits_indices=t(logits_indices, torch.int64),
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_size=block_size,
        request_ids=request_ids,
        sample_request_ids=sample_ids,
        state_slots=tuple(state_slots),
        interior_saves=tuple(interior_saves),
    )
