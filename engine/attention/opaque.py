"""The attention call as one opaque torch op, `fp4serve::paged_attention`, for torch.compile.

A backend plans on the host once per step (Python lists, per-request loops) and its forward
branches on that plan, so dynamo cannot trace into it: each layer's call was a graph break (30
breaks for a 30-layer model, docs/PERF.md). `OpaqueAttention(backend)` is a drop-in backend for
the model's forward whose `forward` is a registered custom op: dynamo keeps it as one node (its
fake implementation gives the output's shape: q's), and at run time the op calls the wrapped
backend's eager forward, which reads the plan made for this step. The KV cache is declared as
mutated, so the op is never reordered or dropped.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.batch import ForwardBatch

# Backends reachable from the op by id: a custom op takes tensors and scalars only.
_BACKENDS: dict[int, AttentionBackend] = {}


@torch.library.custom_op("fp4serve::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, backend_id: int
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], through the registered backend's forward."""
    # NOTE: an op's output may not alias its inputs: backends return fresh tensors (tested).
    return _BACKENDS[backend_id].forward(q, k, v, kv_cache)


@paged_attention.register_fake
def _paged_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, backend_id: int
) -> torch.Tensor:
    return torch.empty_like(q)


class OpaqueAttention:
    """An `AttentionBackend` that hides `backend`'s forward from dynamo behind the custom op."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.backend_id = id(backend)
        _BACKENDS[self.backend_id] = backend

    def plan(self, batch: ForwardBatch) -> None:
        self.backend.plan(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return torch.ops.fp4serve.paged_attention(q, k, v, kv_cache, self.backend_id)
