"""The state checkpoints of hybrid prefix caching, as tensors: a pool of its own beside the state
slots, each checkpoint holding a sequence's Gated DeltaNet state (conv + recurrent, every DeltaNet
layer, float32) after some prefix, and one KV page per attention layer (the MTP head's included)
for a prefix that ends inside a page. The scheduler hands out checkpoint ids and decides every copy
(scheduler/checkpoint_manager.py); this owns the tensors and does the copies, all of them
index_select / index_copy_ on the device, with no host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.state_pool import StatePool
from engine.weights.config.hybrid_config import HybridConfig


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)


class CheckpointPool:
    def __init__(
        self,
        hybrid: HybridConfig,
        num_checkpoints: int,
        kv_page_shape: tuple[int, ...],
        num_kv_layers: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert num_checkpoints >= 1, "a checkpoint pool needs a checkpoint"
        num_layers = len(hybrid.linear_layers)
        self.num_checkpoints = num_checkpoints
        self.device = device
        # NOTE: empty, not zeros: a checkpoint is always written before it is read, and on CPU the
        # pages of an untouched pool are never committed.
        # [num_deltanet_layers, N, conv_dim, kernel - 1] float32
        self.conv = torch.empty(
            num_layers, num_checkpoints, hybrid.conv_dim, hybrid.conv_kernel - 1, dtype=torch.float32, device=device
        )
        # [num_deltanet_layers, N, v_heads, head_k_dim, head_v_dim] float32
        self.recurrent = torch.empty(
            num_layers,
            num_checkpoints,
            hybrid.num_v_heads,
            hybrid.head_k_dim,
            hybrid.head_v_dim,
            dtype=torch.float32,
            device=device,
        )
        # [num_kv_layers, N, 2, block_size, Hkv, D] in the KV cache's dtype: a prefix's partial page
        self.kv = torch.empty(num_kv_layers, num_checkpoints, *kv_page_shape, dtype=kv_dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes + self.kv.nbytes

    @property
    def bytes_per_checkpoint(self) -> int:
        return self.nbytes // self.num_checkpoints

    def save(self, slots: StatePool, checkpoint_ids: Sequence[int], state_slots: Sequence[int]) -> None:
        """Copy the slots' states (all DeltaNet layers) into the checkpoints."""
        if not checkpoint_ids:
            return
        ids, src = _index(checkpoint_ids, self.device), _index(state_slots, self.device)
        self.conv.index_copy_(1, ids, slots.conv.index_select(1, src))
        self.recurrent.index_copy_(1, ids, slots.recurrent.index_select(1, src))

    def restore(self, slots: StatePool, checkpoint_ids: Sequence[int], state_slots: Sequence[int]) -> None:
        """Copy the checkpoints' states into the slots."""
        if not checkpoint_ids:
            return
        ids, dst = _index(checkpoint_ids, self.device), _index(state_slots, self.device)
        slots.conv.index_copy_(1, dst, self.conv.index_select(1, ids))
        slots.recurrent.index_copy_(1, dst, self.recurrent.index_select(1, ids))

    def save_pages(
        self, kv_caches: Sequence[torch.Tensor], checkpoint_ids: Sequence[int], pages: Sequence[int]
    ) -> None:
        """Copy KV pages (every attention layer: kv_caches [num_pages, 2, block_size, Hkv, D] each)
        into the checkpoints."""
        if not checkpoint_ids:
            return
        assert len(kv_caches) == self.kv.shape[0], "one KV cache per checkpointed attention layer"
        ids, src = _index(checkpoint_ids, self.device), _index(pages, self.device)
        for layer, cache in enumerate(kv_caches):
            self.kv[layer].index_copy_(0, ids, cache.index_select(0, src))

    def restore_pages(
        self, kv_caches: Sequence[torch.Tensor], checkpoint_ids: Sequence[int], pages: Sequence[int]
    ) -> None:
        """Copy the checkpoints' KV pages into pages of the KV caches (fresh pages of a request
        whose restored prefix ends inside a page)."""
        if not checkpoint_ids:
            return
        assert len(kv_caches) == self.kv.shape[0], "one KV cache per checkpointed attention layer"
        ids, dst = _index(checkpoint_ids, self.device), _index(pages, self.device)
        for layer, cache in enumerate(kv_caches):
            cache.index_copy_(0, dst, self.kv[layer].index_select(0, ids))

    def write(
        self,
        layer: int,
        checkpoint_ids: torch.Tensor,
        conv: torch.Tensor | None = None,
        recurrent: torch.Tensor | None = None,
    ) -> None:
        """States taken inside a forward (engine/attention/linear_attention.py) for DeltaNet layer `layer`:
        conv [S, conv_dim, kernel - 1], recurrent [S, Hv, Dk, Dv]."""
        if conv is not None:
            self.conv[layer].index_copy_(0, checkpoint_ids, conv.float())
        if recurrent is not None:
            self.recurrent[layer].index_copy_(0, checkpoint_ids, recurrent.float())
