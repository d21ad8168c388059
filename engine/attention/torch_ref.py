"""The torch reference attention backend over the paged KV cache (CPU, and any device).

It reads exactly the FlashInfer metadata of `ForwardBatch`. Decode rows (one query token) are
gathered into one padded batch and run as a single SDPA call; prefill chunks run one SDPA call
each with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] int64: query rows of the decode requests
    pages: torch.Tensor  # [Bd, Lmax] int64: page of each key position (padded with 0)
    offsets: torch.Tensor  # [Bd, Lmax] int64: offset inside the page
    mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool: True where a key exists


@dataclass(frozen=True)
class _PrefillItem:
    q_start: int
    q_end: int
    pages: torch.Tensor  # [num_pages] int64
    seq_len: int
    mask: torch.Tensor  # [q_len, seq_len] bool: causal, offset by the cached tokens


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = device
        self._slot_pages: torch.Tensor | None = None
        self._slot_offsets: torch.Tensor | None = None
        self._decode: _DecodeGroup | None = None
        self._prefills: list[_PrefillItem] = []

    def plan(self, batch: ForwardBatch) -> None:
        bs = batch.block_size
        dev = self.device
        self._slot_pages = torch.div(batch.slot_mapping, bs, rounding_mode="floor")
        self._slot_offsets = batch.slot_mapping % bs
        # Host copies of the metadata: planning happens once per step, not per layer.
        qo = batch.qo_indptr.tolist()
        kv_ptr = batch.kv_indptr.tolist()
        kv_idx = batch.kv_indices.tolist()
        decode_rows: list[int] = []
        decode_pages: list[list[int]] = []
        decode_lens: list[int] = []
        self._prefills = []
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            pages = kv_idx[kv_ptr[i] : kv_ptr[i + 1]]
            if q_len == 1:
                decode_rows.append(qo[i])
                decode_pages.append(pages)
                decode_lens.append(seq_len)
                continue
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
            k_pos = torch.arange(seq_len, device=dev)
            self._prefills.append(
                _PrefillItem(qo[i], qo[i + 1], torch.tensor(pages, device=dev), seq_len, k_pos[None, :] <= q_pos[:, None])
            )
        self._decode = None
        if decode_rows:
            lmax = max(decode_lens)
            pos = torch.arange(lmax)
            page_slot = []
            for pages, n in zip(decode_pages, decode_lens):
                idx = torch.tensor(pages, dtype=torch.int64)[torch.clamp(pos, max=n - 1) // bs]
                page_slot.append(idx)
            lens = torch.tensor(decode_lens)
            self._decode = _DecodeGroup(
                rows=torch.tensor(decode_rows, device=dev),
                pages=torch.stack(page_slot).to(dev),
                offsets=(pos % bs).expand(len(decode_rows), lmax).to(dev),
                mask=(pos[None, :] < lens[:, None]).to(dev)[:, None, None, :],
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self._slot_pages is not None, "plan() must run before forward()"
        # Write every new K/V of the batch first: same-step prefix hits read them.
        kv_cache[self._slot_pages, 0, self._slot_offsets] = k.to(kv_cache.dtype)
        kv_cache[self._slot_pages, 1, self._slot_offsets] = v.to(kv_cache.dtype)
        out = torch.empty_like(q)
        if self._decode is not None:
            d = self._decode
            keys = kv_cache[d.pages, 0, d.offsets]  # [Bd, L, Hkv, D]
            values = kv_cache[d.pages, 1, d.offsets]
            o = F.scaled_dot_product_attention(
                q[d.rows][:, :, None, :],  # [Bd, Hq, 1, D]
                keys.transpose(1, 2).to(q.dtype),
                values.transpose(1, 2).to(q.dtype),
                attn_mask=d.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[d.rows] = o[:, :, 0, :]
        for p in self._prefills:
            keys = kv_cache[p.pages, 0].flatten(0, 1)[: p.seq_len]  # [L, Hkv, D]
            values = kv_cache[p.pages, 1].flatten(0, 1)[: p.seq_len]
            o = F.scaled_dot_product_attention(
                q[p.q_start : p.q_end].transpose(0, 1)[None],  # [1, Hq, Lq, D]
                keys.transpose(0, 1)[None].to(q.dtype),
                values.transpose(0, 1)[None].to(q.dtype),
                attn_mask=p.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        return out
