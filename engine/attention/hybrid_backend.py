"""The backend a hybrid model's forward receives: the attention backend (paged KV, gated-attention
layers) and the linear-attention backend (state slots, DeltaNet layers), planned together once per
step. It is an `AttentionBackend` itself, so the model runner and the eager forward path treat a
hybrid model like a dense one; with an attention backend that can be captured it is a graph
backend too (engine/cuda_graph.py): both halves plan a padded step into their fixed buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.linear_attention import LinearAttentionBackend, TorchLinearAttentionBackend
from engine.batch import ForwardBatch


class HybridBackend:
    def __init__(self, attention: AttentionBackend, linear: LinearAttentionBackend) -> None:
        self.attention = attention
        self.linear = linear
        self.name = f"{attention.name} + {linear.name} (linear attention)"

    @property
    def scratch_slot(self) -> int:
        """The state slot padded rows of a graph step use (no request holds it)."""
        assert isinstance(self.linear, TorchLinearAttentionBackend), f"{self.linear.name} has no state pool"
        return self.linear.pool.scratch_slot

    def plan(self, batch: ForwardBatch) -> None:
        self.attention.plan(batch)
        self.linear.plan(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.attention.forward(q, k, v, kv_cache)

    # ---- CUDA graphs: both halves, when the attention half can be captured ------------------------
    def graph_capable(self) -> bool:
        return all(callable(getattr(self.attention, m, None)) for m in ("prepare_graphs", "plan_graph")) and isinstance(
            self.linear, TorchLinearAttentionBackend
        )

    def verify_graph_capable(self) -> bool:
        return self.graph_capable() and callable(getattr(self.attention, "prepare_verify_graphs", None))

    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        assert self.graph_capable(), f"the {self.name} backend cannot be captured"
        self.attention.prepare_graphs(batch_sizes, max_num_pages)  # type: ignore[attr-defined]
        self.linear.prepare_graphs(batch_sizes)  # type: ignore[attr-defined]

    def prepare_verify_graphs(self, batch_sizes: Sequence[int], query_len: int, max_num_pages: int) -> None:
        assert self.verify_graph_capable(), f"the {self.name} backend cannot capture verify steps"
        self.attention.prepare_verify_graphs(batch_sizes, query_len, max_num_pages)  # type: ignore[attr-defined]
        self.linear.prepare_graphs(batch_sizes)  # type: ignore[attr-defined]

    def plan_graph(self, batch: ForwardBatch) -> None:
        self.attention.plan_graph(batch)  # type: ignore[attr-defined]
        self.linear.plan_graph(batch)  # type: ignore[attr-defined]
