"""The attention-backend Protocol: planned once per step from a `ForwardBatch`, then called
by every layer with that layer's new q/k/v and its paged KV cache."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.batch import ForwardBatch


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata shared by all layers (outside any CUDA graph)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write k/v of the new tokens into `kv_cache`, then attend causally.

        q [T, Hq, D], k/v [T, Hkv, D]; kv_cache [num_pages, 2, block_size, Hkv, D] (NHD, K then V).
        Returns [T, Hq, D]. All new K/V of the batch are written before any is read, so a
        request may read pages another request of the same step writes (prefix hits).
        """


def kv_cache_shape(num_pages: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """FlashInfer's single-tensor NHD paged layout."""
    return (num_pages, 2, block_size, num_kv_heads, head_dim)
