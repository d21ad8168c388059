"""`InputBatch`: the step's input tensors in buffers that persist across steps (vLLM v1's
persistent `InputBatch`). Each request keeps a row of a block-table array whose pages are written
only where they may have changed; the flat metadata is built from it with numpy (no Python loop
over tokens or pages), staged in pinned host memory on CUDA and copied to the device once per
tensor. It builds exactly what engine/batch.py `build_forward_batch` does."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.batch import ForwardBatch
from scheduler.output import SchedulerOutput

# name -> dtype of each tensor a step copies to the device
_FIELDS = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "qo_indptr": torch.int32,
    "kv_indptr": torch.int32,
    "kv_indices": torch.int32,
    "kv_last_page_len": torch.int32,
    "logits_indices": torch.int64,
}


class _Staging:
    """One set of host buffers (pinned on CUDA) and the event after their last copy out."""

    def __init__(self, sizes: dict[str, int], pin: bool) -> None:
        self.tensors = {k: torch.empty(sizes[k], dtype=dt, pin_memory=pin) for k, dt in _FIELDS.items()}
        self.arrays = {k: t.numpy() for k, t in self.tensors.items()}  # views of the same memory
        self.copied: torch.cuda.Event | None = None


class InputBatch:
    def __init__(
        self, max_num_seqs: int, max_num_tokens: int, max_pages_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        # [max_num_seqs, max_pages_per_seq] int32, host: each live request's pages, by row
        self.block_table = np.zeros((max_num_seqs, max_pages_per_seq), dtype=np.int32)
        self._num_pages_written = np.zeros(max_num_seqs, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        sizes = {
            "input_ids": max_num_tokens,
            "positions": max_num_tokens,
            "slot_mapping": max_num_tokens,
            "qo_indptr": max_num_seqs + 1,
            "kv_indptr": max_num_seqs + 1,
            "kv_indices": max_num_seqs * max_pages_per_seq,
            "kv_last_page_len": max_num_seqs,
            "logits_indices": max_num_tokens,
        }
        on_cuda = device.type == "cuda"
        # Two staging sets on CUDA: a step's copies may still be queued while the next is built.
        self._staging = [_Staging(sizes, on_cuda) for _ in range(2 if on_cuda else 1)]
        self._turn = 0
        # The device buffers each step's tensors are views of (the staging itself on CPU).
        self._device = (
            {k: torch.empty(sizes[k], dtype=dt, device=device) for k, dt in _FIELDS.items()} if on_cuda else None
        )

    def remove_request(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._num_pages_written[row] = 0
            self._free_rows.append(row)

    def _row(self, request_id: str, in_step: set[str]) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free_rows:
                # Preempted requests keep rows while others run: one not in this step gives its row
                # up (its pages are written in full when it returns).
                idle = next(rid for rid in self._rows if rid not in in_step)
                self.remove_request(idle)
            row = self._rows[request_id] = self._free_rows.pop()
        return row

    def build(self, out: SchedulerOutput) -> ForwardBatch:
        """The step's ForwardBatch. NOTE: its tensors are views of the persistent buffers, valid
        until the next build (the device reads them in stream order)."""
        for request_id in out.finished_request_ids:
            self.remove_request(request_id)
        bs = self.block_size
        reqs = out.requests
        num_reqs = len(reqs)
        rows = np.empty(num_reqs, dtype=np.int64)
        starts = np.empty(num_reqs, dtype=np.int64)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        num_samples = np.zeros(num_reqs, dtype=np.int64)  # logits rows per request: 0, or 1 + drafts
        state_slots: list[int] = []
        interior_saves: list[tuple[int, int, int]] = []
        bt = self.block_table
        in_step = {r.request_id for r in reqs} if len(self._rows) + num_reqs > self.max_num_seqs else set()
        for i, r in enumerate(reqs):
            row = self._row(r.request_id, in_step)
            rows[i] = row
            starts[i] = r.start_pos
            n = len(r.token_ids)
            seq_len = r.start_pos + n
            query_lens.append(n)
            seq_lens.append(seq_len)
            table = r.block_table
            # Pages before the one start_pos falls in hold computed KV: they never change while the
            # request runs. Those after may (new pages, rejected drafts' pages trimmed); a request
            # admitted this step (back from preemption too) has a new table.
            first = 0 if r.resumed else min(r.start_pos // bs, int(self._num_pages_written[row]))
            if len(table) > first:
                bt[row, first : len(table)] = table[first:]
            self._num_pages_written[row] = len(table)
            if r.sample:
                num_samples[i] = 1 + r.num_draft_tokens
            if r.state_slot is not None:
                state_slots.append(r.state_slot)
            if r.checkpoint_saves:
                interior_saves.extend(
                    (i, s.num_tokens - r.start_pos, s.checkpoint_id)
                    for s in r.checkpoint_saves
                    if s.num_tokens < seq_len
                )
        staging = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if staging.copied is not None:
            staging.copied.synchronize()  # its copies of two steps ago have left the host buffers
        a = staging.arrays
        n_arr = np.asarray(query_lens, dtype=np.int64)
        seq_arr = np.asarray(seq_lens, dtype=np.int64)
        num_tokens = int(n_arr.sum())
        a["input_ids"][:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in reqs), dtype=np.int64, count=num_tokens
        )
        qo = a["qo_indptr"][: num_reqs + 1]
        qo[0] = 0
        np.cumsum(n_arr, out=qo[1:])
        # positions: start_pos + the row's index within its request, for every row
        token_req = np.repeat(np.arange(num_reqs), n_arr)  # [T] request index of each row
        positions = a["positions"][:num_tokens]
        np.add(np.arange(num_tokens), np.repeat(starts - qo[:-1], n_arr), out=positions)
        token_rows = rows[token_req]
        a["slot_mapping"][:num_tokens] = bt[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        num_pages = -(-seq_arr // bs)
        kv = a["kv_indptr"][: num_reqs + 1]
        kv[0] = 0
        np.cumsum(num_pages, out=kv[1:])
        num_kv = int(kv[-1])
        page_in_req = np.arange(num_kv) - np.repeat(kv[:-1].astype(np.int64), num_pages)
        a["kv_indices"][:num_kv] = bt[np.repeat(rows, num_pages), page_in_req]
        a["kv_last_page_len"][:num_reqs] = seq_arr - (num_pages - 1) * bs
        num_logits = int(num_samples.sum())
        ends = qo[1:].astype(np.int64)
        a["logits_indices"][:num_logits] = (
            np.repeat(ends - num_samples, num_samples)
            + np.arange(num_logits)
            - np.repeat(np.cumsum(num_samples) - num_samples, num_samples)
        )
        used = {
            "input_ids": num_tokens,
            "positions": num_tokens,
            "slot_mapping": num_tokens,
            "qo_indptr": num_reqs + 1,
            "kv_indptr": num_reqs + 1,
            "kv_indices": num_kv,
            "kv_last_page_len": num_reqs,
            "logits_indices": num_logits,
        }
        tensors = self._to_device(staging, used)
        return ForwardBatch(
            **tensors,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_size=bs,
            request_ids=[r.request_id for r in reqs],
            sample_request_ids=[r.request_id for r in reqs if r.sample],
            state_slots=tuple(state_slots),
            interior_saves=tuple(interior_saves),
        )

    def _to_device(self, staging: _Staging, used: dict[str, int]) -> dict[str, torch.Tensor]:
        """One copy per tensor, of the rows this step uses (no copy on CPU: the buffers are it)."""
        if self._device is None:
            # Fresh tensors for the caller to own: the model may keep a view past this build.
            return {k: staging.tensors[k][:n].clone() for k, n in used.items()}
        views = {}
        for k, n in used.items():
            dst = self._device[k][:n]
            dst.copy_(staging.tensors[k][:n], non_blocking=True)
            views[k] = dst
        staging.copied = torch.cuda.Event()
        staging.copied.record()
        return views
