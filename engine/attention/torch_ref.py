"""The torch reference attention backend over the paged KV cache (CPU, and any device).

It reads exactly the FlashInfer metadata of `ForwardBatch`. Decode rows (one query token) are
gathered into one padded batch and run as a single SDPA call. A prefill chunk of C new tokens
after P cached ones attends, on CPU, without a mask: its queries against the P earlier keys
(nothing to mask) and against its own C keys (causal), the two merged by their log-sum-exps
(`chunk_attention`); on other devices, one SDPA call with a causal mask offset by P.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch
from engine.host.cpu_threads import serial_cpu_ops

# NOTE: the cache [P, 2, bs, H, D] is addressed through its flat view [P * 2 * bs, H, D]:
# K of (page, offset) is row page*2*bs + offset, V is that + bs. index_copy_/index_select on
# the flat view are ~10x faster than advanced indexing with a slice in the middle.


_SMALL_DECODE_BATCH = 4  # decode batches up to this size skip SDPA (see _small_decode_attention)
# Small decode batches run the KV write and attention on the calling thread alone (see
# engine/host/cpu_threads.py); a module setting, so that a benchmark can A/B it in one process.
SERIAL_SMALL_DECODE = True
# Prefill chunks on CPU attend through `chunk_attention`, no mask; False: the masked SDPA call of
# other devices (a module setting, so that bench/prefill_curve.py can A/B the two in one process).
MASK_FREE_PREFILL = True


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] int64: query rows of the decode requests
    k_rows: torch.Tensor  # [Bd * Lmax] int64: flat cache rows of each key position (padded)
    lmax: int
    mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool: True where a key exists; None: no padding
    all_rows: bool  # the batch is these decode rows, in order: no gather of q, no scatter of out

    @property
    def small(self) -> bool:
        """Few enough rows for the two-matmul path (and the serial one on CPU)."""
        return len(self.rows) <= _SMALL_DECODE_BATCH


@dataclass(frozen=True)
class _PrefillItem:
    q_start: int
    q_end: int
    k_rows: torch.Tensor  # [seq_len] int64: flat cache rows of the request's keys
    mask: torch.Tensor | None  # [q_len, seq_len] bool: causal, offset by the cached tokens; None on CPU


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk on CPU: q [1, Hq, C, D] after P = L - C cached keys, keys/values [1, Hkv, L, D]
    (any strides; GQA as SDPA's enable_gqa) -> [1, Hq, C, D] float32, each query row causal over
    the keys up to its own position, without building the [C, L] mask.

    NOTE: with an explicit mask, torch's CPU flash kernel reads the mask for every score and
    cannot skip the blocks above the diagonal, so it did the whole [C, L] product plus the mask;
    here the P earlier keys need no mask at all and the chunk's own keys are plain causal (whose
    blocks above the diagonal the kernel skips). Its CPU variant returns each row's log-sum-exp,
    which merges the two parts exactly: softmax over all keys = the parts' outputs weighted by
    exp(lse_part - lse_all)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    cached = keys.shape[2] - q.shape[2]
    own, lse_own = flash(q, keys[:, :, cached:], values[:, :, cached:], 0.0, True, scale=scale)
    if cached == 0:
        return own.float()
    past, lse_past = flash(q, keys[:, :, :cached], values[:, :, :cached], 0.0, False, scale=scale)
    weight = torch.sigmoid(lse_past - lse_own)[..., None]  # = exp(lse_past - lse_all), [1, Hq, C, 1]
    return torch.lerp(own.float(), past.float(), weight)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = device
        self._new_k_rows: torch.Tensor | None = None  # [T] int64
        self._block_size = 0
        self._decode: _DecodeGroup | None = None
        self._prefills: list[_PrefillItem] = []

    def plan(self, batch: ForwardBatch) -> None:
        bs = batch.block_size
        dev = self.device
        self._block_size = bs
        slots = batch.slot_mapping
        self._new_k_rows = torch.div(slots, bs, rounding_mode="floor") * (2 * bs) + slots % bs
        # Host copies of the metadata: planning happens once per step, not per layer.
        qo = batch.qo_indptr.tolist()
        kv_ptr = batch.kv_indptr.tolist()
        kv_idx = batch.kv_indices.tolist()
        decode_rows: list[int] = []
        decode_k_rows: list[torch.Tensor] = []
        decode_lens: list[int] = []
        self._prefills = []
        offsets = torch.arange(bs)
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            pages = torch.tensor(kv_idx[kv_ptr[i] : kv_ptr[i + 1]], dtype=torch.int64)
            k_rows = ((pages * (2 * bs))[:, None] + offsets[None, :]).flatten()[:seq_len]  # [seq_len]
            if q_len == 1:
                decode_rows.append(qo[i])
                decode_k_rows.append(k_rows)
                decode_lens.append(seq_len)
                continue
            self._prefills.append(self._prefill_item(qo[i], q_len, seq_len, k_rows))
        self._decode = None
        if decode_rows:
            lmax = max(decode_lens)
            padded = torch.zeros(len(decode_rows), lmax, dtype=torch.int64)
            for j, rows in enumerate(decode_k_rows):
                padded[j, : len(rows)] = rows
            mask = torch.arange(lmax)[None, :] < torch.tensor(decode_lens)[:, None]  # [Bd, Lmax]
            self._decode = _DecodeGroup(
                rows=torch.tensor(decode_rows, device=dev),
                k_rows=padded.flatten().to(dev),
                lmax=lmax,
                mask=None if min(decode_lens) == lmax else mask.to(dev)[:, None, None, :],
                all_rows=not self._prefills and decode_rows == list(range(len(decode_rows))),
            )

    def plan_prefills(self, batch: ForwardBatch, min_rows: int) -> None:
        """Plan only the requests of at least `min_rows` query rows, for `attend_prefills` alone
        (engine/attention/cpu_paged.py attends the other rows itself)."""
        bs = batch.block_size
        self._block_size = bs
        qo, kv_ptr, kv_idx = batch.qo_indptr.tolist(), batch.kv_indptr.tolist(), batch.kv_indices.tolist()
        offsets = torch.arange(bs)
        self._prefills = []
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            if q_len >= min_rows:
                pages = torch.tensor(kv_idx[kv_ptr[i] : kv_ptr[i + 1]], dtype=torch.int64)
                k_rows = ((pages * (2 * bs))[:, None] + offsets[None, :]).flatten()[:seq_len]  # [seq_len]
                self._prefills.append(self._prefill_item(qo[i], q_len, seq_len, k_rows))

    def _prefill_item(self, q_start: int, q_len: int, seq_len: int, k_rows: torch.Tensor) -> _PrefillItem:
        mask = None
        if self.device.type != "cpu" or not MASK_FREE_PREFILL:  # chunk_attention is CPU only
            q_pos = torch.arange(seq_len - q_len, seq_len, device=self.device)
            mask = torch.arange(seq_len, device=self.device)[None, :] <= q_pos[:, None]
        return _PrefillItem(q_start, q_start + q_len, k_rows.to(self.device), mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self._new_k_rows is not None, "plan() must run before forward()"
        flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # [P*2*bs, Hkv, D]
        d = self._decode
        if d is not None and d.all_rows:
            with serial_cpu_ops(SERIAL_SMALL_DECODE and d.small and flat.device.type == "cpu"):
                self._write_kv(flat, k, v)
                return self._decode_attention(q, flat, d)
        self._write_kv(flat, k, v)
        out = torch.empty_like(q)
        if d is not None:
            out[d.rows] = self._decode_attention(q[d.rows], flat, d)
        self.attend_prefills(q, kv_cache, out)
        return out

    def attend_prefills(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """The planned prefill chunks' rows of `out` (the K/V already written), each over the
        request's gathered keys, causal from the tokens already cached: `chunk_attention` on CPU,
        else one SDPA call with the mask."""
        bs = self._block_size
        flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # [P*2*bs, Hkv, D]
        for p in self._prefills:
            keys = flat.index_select(0, p.k_rows).to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = flat.index_select(0, p.k_rows + bs).to(q.dtype).transpose(0, 1)[None]
            rows = q[p.q_start : p.q_end].transpose(0, 1)[None]  # [1, Hq, Lq, D]
            if p.mask is None:
                o = chunk_attention(rows, keys, values, self.scale)
            else:
                o = F.scaled_dot_product_attention(
                    rows, keys, values, attn_mask=p.mask, scale=self.scale, enable_gqa=True
                )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)

    def _write_kv(self, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write every new K/V of the batch first: same-step prefix hits read them."""
        assert self._new_k_rows is not None
        flat.index_copy_(0, self._new_k_rows, k.to(flat.dtype))
        flat.index_copy_(0, self._new_k_rows + self._block_size, v.to(flat.dtype))

    def _decode_attention(self, q: torch.Tensor, flat: torch.Tensor, d: _DecodeGroup) -> torch.Tensor:
        """q [Bd, Hq, D] of the decode rows -> [Bd, Hq, D] over their gathered keys."""
        num = len(d.rows)
        keys = flat.index_select(0, d.k_rows).view(num, d.lmax, *flat.shape[1:])  # [Bd, L, Hkv, D]
        values = flat.index_select(0, d.k_rows + self._block_size).view(num, d.lmax, *flat.shape[1:])
        if d.small:
            return self._small_decode_attention(q, keys.to(q.dtype), values.to(q.dtype), d.mask)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [Bd, Hq, 1, D]
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=d.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]

    def _small_decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Softmax attention as two batched matmuls, each query head grouped with its KV head.

        NOTE: at a batch of a few rows, the CPU flash-attention kernel splits 9-36 head tasks over
        the OpenMP threads: one parallel region per layer whose wake-up, on a busy machine, cost
        far more than its ~30 us of work (py-spy: 44% of a batch-1 step's wall time inside it,
        docs/PERF.md). These small matmuls run on the calling thread."""
        num, lmax, num_kv_heads, head_dim = keys.shape
        group = self.num_heads // num_kv_heads
        scores = torch.matmul(q.reshape(num, num_kv_heads, group, head_dim), keys.permute(0, 2, 3, 1))  # [B, Hkv, G, L]
        scores.mul_(self.scale)
        if mask is not None:
            scores.masked_fill_(~mask, -math.inf)  # mask [B, 1, 1, L]
        out = torch.matmul(scores.softmax(dim=-1), values.transpose(1, 2))  # [B, Hkv, G, D]
        return out.reshape(num, self.num_heads, head_dim)
