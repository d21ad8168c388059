"""The Gated DeltaNet backend on CUDA: fla-core's Triton kernels over the flattened batch with
per-sequence `cu_seqlens` and initial/final states gathered from and written back to the state
slots (chunk_gated_delta_rule for steps with a prefill, fused_recurrent_gated_delta_rule for pure
decode). The conv stays the torch one (`TorchLinearAttentionBackend.conv`), cheap next to the rule.
A CUDA-graph step (B requests of L rows each) runs fused_recurrent_gated_delta_rule over the plain
[B, L] layout with no cu_seqlens: nothing in it is planned on the host.

Hybrid prefix caching needs states part way through a request's rows (`ForwardBatch.
interior_saves`; a state at the end of a request's rows is its slot, copied by the model runner).
fla-core's chunk kernel gives a sequence's final state only (`output_final_state`), so the call is
split at those positions into rounds: round j runs the j-th piece of every request cut into more
than j pieces, from the states round j - 1 ended with, and its final states are the states kept.
No other kernel: a step with no state to keep part way is one call as before, and a step with m
cuts in one request is m + 1 calls per DeltaNet layer.

    request a: [a0 .. a99 | a100 .. a129]   kept after 100 tokens
    request b: [b0 .. b39]
    round 0: cu_seqlens [0, 100, 140] over a0..a99, b0..b39 (initial states: the slots)
    round 1: cu_seqlens [0, 30] over a100..a129 (initial state: round 0's final of a)

NOTE: written against fla-core 0.6.0 and CPU-checked only through a torch stand-in with its varlen
signature (tests/engine/test_checkpoint_kernels.py); it has never run on a GPU in this project
(tests/gpu/test_fla_backend.py is the check to run there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.linear_attention import TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.batch import ForwardBatch

# fla-core's chunk_gated_delta_rule / fused_recurrent_gated_delta_rule (or a stand-in with their signature)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Round:
    """One kernel call of a step split at kept states: a piece of some of the batch's requests."""

    tokens: torch.Tensor  # [T_j] int64: the pieces' rows of the flattened batch, in order
    cu_seqlens: torch.Tensor  # [n_j + 1] int64
    requests: torch.Tensor  # [n_j] int64: each piece's request (index in the batch)
    save_pieces: torch.Tensor | None  # [S_j] int64: pieces whose final state is kept
    save_ids: torch.Tensor | None  # [S_j] int64: their checkpoint ids

    @staticmethod
    def split(batch: ForwardBatch, device: torch.device) -> list[Round]:
        cuts: dict[int, list[tuple[int, int]]] = {}  # request -> (rows done, checkpoint id), ascending
        for index, done, checkpoint_id in batch.interior_saves:
            cuts.setdefault(index, []).append((done, checkpoint_id))
        pieces: list[list[tuple[int, int, int, int | None]]] = []  # per round: (request, start, end, kept id)
        start = 0
        for index, n in enumerate(batch.query_lens):
            bounds = sorted(cuts.get(index, ()))
            edges = [0] + [done for done, _ in bounds] + [n]
            for j in range(len(edges) - 1):
                kept = bounds[j][1] if j < len(bounds) else None
                while len(pieces) <= j:
                    pieces.append([])
                pieces[j].append((index, start + edges[j], start + edges[j + 1], kept))
            start += n
        rounds = []
        for round_pieces in pieces:
            tokens = [row for _, a, b, _ in round_pieces for row in range(a, b)]
            cu = [0]
            for _, a, b, _ in round_pieces:
                cu.append(cu[-1] + b - a)
            saves = [(i, kept) for i, (_, _, _, kept) in enumerate(round_pieces) if kept is not None]

            def t(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

            rounds.append(
                Round(
                    t(tokens),
                    t(cu),
                    t([r for r, _, _, _ in round_pieces]),
                    t([i for i, _ in saves]) if saves else None,
                    t([c for _, c in saves]) if saves else None,
                )
            )
        return rounds


class FlaLinearAttentionBackend(TorchLinearAttentionBackend):
    name = "fla"

    def __init__(
        self,
        pool: StatePool,
        device: torch.device,
        checkpoints: CheckpointPool | None = None,
        kernels: tuple[Kernel, Kernel] | None = None,
    ) -> None:
        """kernels: (chunk, fused recurrent); None: fla-core's."""
        super().__init__(pool, device, checkpoints=checkpoints)
        if kernels is None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

            kernels = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
        self._chunk, self._recurrent = kernels
        self._cu_seqlens: torch.Tensor | None = None  # [B+1] int64: the batch's segments, in order
        self._slots: torch.Tensor | None = None  # [B] int64: each request's slot
        self._pure_decode = False
        self._rounds: list[Round] = []  # empty: one call over the whole batch

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self._cu_seqlens = batch.qo_indptr.to(self.device, torch.int64)
        self._slots = torch.tensor(batch.state_slots, dtype=torch.int64, device=self.device)
        self._pure_decode = all(n == 1 for n in batch.query_lens)
        self._rounds = Round.split(batch, self.device) if batch.interior_saves else []

    def delta_rule(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        if self._graph_shape is not None:
            return self._graph_delta_rule(layer, q, k, v, g, beta)
        assert self._slots is not None and self._cu_seqlens is not None, "plan() must run before the forward"
        states = self.pool.recurrent[layer]  # [S, Hv, Dk, Dv] float32
        if self._rounds:
            return self._delta_rule_rounds(layer, q, k, v, g, beta, states)
        rule = self._recurrent if self._pure_decode else self._chunk
        # varlen: one "batch" of all tokens, [1, T, H, D]; GVA (Hv > Hk) is native to the kernels
        out, final = rule(
            q[None],
            k[None],
            v.contiguous()[None],
            g=g[None],
            beta=beta[None],
            initial_state=states[self._slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=self._cu_seqlens,
        )
        states.index_copy_(0, self._slots, final.float())
        return out[0]

    def _uniform_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] rows, each its own sequence: fla's batch layout, initial states [B, Hv, Dk, Dv]."""
        return self._recurrent(
            q,
            k,
            v.contiguous(),
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    def _delta_rule_rounds(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> torch.Tensor:
        assert self._slots is not None and self.checkpoints is not None, "rounds keep states in the checkpoint pool"
        current = states[self._slots]  # [B, Hv, Dk, Dv] float32: each request's state so far
        out = torch.empty_like(v)
        for rnd in self._rounds:
            rows = rnd.tokens
            kwargs: dict[str, Any] = dict(
                initial_state=current[rnd.requests],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=rnd.cu_seqlens,
            )
            o, final = self._chunk(
                q[rows][None],
                k[rows][None],
                v[rows].contiguous()[None],
                g=g[rows][None],
                beta=beta[rows][None],
                **kwargs,
            )
            out[rows] = o[0]
            current = current.index_copy(0, rnd.requests, final.float())
            if rnd.save_pieces is not None and rnd.save_ids is not None:
                self.checkpoints.write(layer, rnd.save_ids, recurrent=final[rnd.save_pieces])
        states.index_copy_(0, self._slots, current)
        return out
