"""The backend a hybrid model's forward receives: the attention backend (paged KV, gated-attention
layers) and the linear-attention backend (state slots, DeltaNet layers), planned together once per
step. It is an `AttentionBackend` itself, so the model runner and the eager forward path treat a
hybrid model like a dense one."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.linear_attention import LinearAttentionBackend
from engine.batch import ForwardBatch


class HybridBackend:
    def __init__(self, attention: AttentionBackend, linear: LinearAttentionBackend) -> None:
        self.attention = attention
        self.linear = linear
        self.name = f"{attention.name} + {linear.name} (linear attention)"

    def plan(self, batch: ForwardBatch) -> None:
        self.attention.plan(batch)
        self.linear.plan(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.attention.forward(q, k, v, kv_cache)
