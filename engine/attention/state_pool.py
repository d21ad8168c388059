"""The state slots of a hybrid model: one fixed pool, sized at start-up beside the KV pages, holding
each running sequence's Gated DeltaNet state (conv + recurrent, all DeltaNet layers, float32).
The scheduler hands out slot ids 0..num_slots-1 (scheduler/slot_manager.py); this owns the tensors,
plus one scratch slot past them that no request ever holds: the padded rows of a CUDA-graph step
read and write only there (engine/cuda_graph.py), as they write KV only to the scratch page."""

from __future__ import annotations

import torch

from engine.weights.config.hybrid_config import HybridConfig


class StatePool:
    def __init__(self, hybrid: HybridConfig, num_slots: int, device: torch.device) -> None:
        assert num_slots >= 1, "a hybrid model needs at least one state slot"
        num_layers = len(hybrid.linear_layers)
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # one row past the scheduler's slots
        # [num_deltanet_layers, num_slots + 1, conv_dim, kernel - 1] float32: the last inputs of the conv
        self.conv = torch.zeros(
            num_layers, num_slots + 1, hybrid.conv_dim, hybrid.conv_kernel - 1, dtype=torch.float32, device=device
        )
        # [num_deltanet_layers, num_slots + 1, v_heads, head_k_dim, head_v_dim] float32
        self.recurrent = torch.zeros(
            num_layers,
            num_slots + 1,
            hybrid.num_v_heads,
            hybrid.head_k_dim,
            hybrid.head_v_dim,
            dtype=torch.float32,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of `slots` [N] int64 (sequences starting at position 0), all layers."""
        self.conv.index_fill_(1, slots, 0.0)
        self.recurrent.index_fill_(1, slots, 0.0)
