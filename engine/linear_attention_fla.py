"""The Gated DeltaNet backend on CUDA: fla-core's Triton kernels over the flattened batch with
per-sequence `cu_seqlens` and initial/final states gathered from and written back to the state
slots (chunk_gated_delta_rule for steps with a prefill, fused_recurrent_gated_delta_rule for pure
decode). The conv stays the torch one (`TorchLinearAttentionBackend.conv`), cheap next to the rule.

NOTE: written against fla-core 0.6.0 and CPU-checked only for its shapes; it has never run on a
GPU in this project (tests/gpu/test_fla_backend.py is the check to run there)."""

from __future__ import annotations

import torch

from engine.batch import ForwardBatch
from engine.linear_attention import TorchLinearAttentionBackend
from engine.state_pool import StatePool


class FlaLinearAttentionBackend(TorchLinearAttentionBackend):
    name = "fla"

    def __init__(self, pool: StatePool, device: torch.device) -> None:
        super().__init__(pool, device)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self._chunk = chunk_gated_delta_rule
        self._recurrent = fused_recurrent_gated_delta_rule
        self._cu_seqlens: torch.Tensor | None = None  # [B+1] int64: the batch's segments, in order
        self._slots: torch.Tensor | None = None  # [B] int64: each request's slot
        self._pure_decode = False

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self._cu_seqlens = batch.qo_indptr.to(self.device, torch.int64)
        self._slots = torch.tensor(batch.state_slots, dtype=torch.int64, device=self.device)
        self._pure_decode = all(n == 1 for n in batch.query_lens)

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None and self._cu_seqlens is not None, "plan() must run before the forward"
        states = self.pool.recurrent[layer]  # [S, Hv, Dk, Dv] float32
        rule = self._recurrent if self._pure_decode else self._chunk
        # varlen: one "batch" of all tokens, [1, T, H, D]; GVA (Hv > Hk) is native to the kernels
        out, final = rule(q[None], k[None], v.contiguous()[None], g=g[None], beta=beta[None],
                          initial_state=states[self._slots], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=self._cu_seqlens)
        states.index_copy_(0, self._slots, final.float())
        return out[0]
