"""The linear-attention (Gated DeltaNet) backend: planned once per step from a `ForwardBatch`, then
called by every DeltaNet layer for its conv and its delta rule over the state slots.

Each step's requests split into three groups, with no Python loop over sequences inside a layer:
decodes (one token each) run the recurrent form on [Bd] rows; short rows (2..SHORT_ROW_MAX tokens:
speculative verify steps, the recompute chunk after a rejected draft, short prompts) are padded to
one [Bs, Ls] layout and run the recurrence token by token; longer prefill chunks are padded to one
[Bp, Lp] layout and run the chunked form. Each request reads and writes its own slot; a request
starting at position 0 has its slot zeroed at plan time.

    tokens  [a0 .. a39 | b0 | c0 c1 | d0 d1 d2 | e0]   (a: long chunk; c, d: short rows; b, e: decodes)
    prefill rows [[a0 .. a39]]                         short rows [[c0 c1 pad], [d0 d1 d2]]
    decode rows  [b0, e0]                              short mask [[1 1 0], [1 1 1]]

SHORT_ROW_MAX = 16 by measurement (docs/PERF.md, "Short rows"): the chunked form pays for a whole
padded chunk of 64 whatever the row's length, the recurrence pays per token; on tiny test models
they break even near 16 tokens, at Qwen3.5's DeltaNet sizes the recurrence is still far cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.batch import ForwardBatch
from engine.models.gated_delta import (causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule,
                                       sequential_gated_delta_rule)
from engine.state_pool import StatePool

SHORT_ROW_MAX = 16  # rows of up to this many tokens run the recurrence (see the module docstring)


class LinearAttentionBackend(Protocol):
    name: str

    def plan(self, batch: ForwardBatch) -> None:
        """Per-step segments of the batch; zero the slots of sequences that start now."""

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """SiLU(causal depthwise conv) of x [T, C] with weight [C, K], carrying each sequence's
        conv state in its slot of DeltaNet layer `layer`. Returns [T, C]."""

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
        """q/k [T, Hk, Dk] (not yet L2-normed), v [T, Hv, Dv], g/beta [T, Hv]; reads and writes
        the recurrent state slots. Returns [T, Hv, Dv] in v's dtype."""


@dataclass(frozen=True)
class Segments:
    """One group of requests laid out as [B, L] token rows (pads at the end of short rows)."""

    rows: torch.Tensor  # [B, L] int64 token rows; pads repeat row 0
    mask: torch.Tensor  # [B, L] bool: True on real tokens
    lengths: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 state slot of each request
    flat_rows: torch.Tensor  # [sum(lengths)] int64 = rows[mask]

    @staticmethod
    def build(starts: list[int], lengths: list[int], slots: list[int], device: torch.device) -> Segments:
        width = max(lengths)
        rows = torch.tensor([[s + min(j, n - 1) for j in range(width)] for s, n in zip(starts, lengths)],
                            dtype=torch.int64)
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return Segments(rows.to(device), mask.to(device), torch.tensor(lengths, device=device),
                        torch.tensor(slots, dtype=torch.int64, device=device), rows[mask].to(device))


@dataclass(frozen=True)
class LinearAttentionPlan:
    decode: Segments | None  # requests with one new token: L = 1
    prefill: Segments | None  # requests with more than short_max new tokens: the chunked form
    num_tokens: int
    short: Segments | None = None  # requests with 2..short_max new tokens: the recurrence

    @staticmethod
    def build(batch: ForwardBatch, device: torch.device,
              short_max: int = SHORT_ROW_MAX) -> tuple[LinearAttentionPlan, list[int]]:
        """The plan and the slots of sequences starting at position 0 (to be zeroed)."""
        assert len(batch.state_slots) == batch.num_requests, "a hybrid batch needs a state slot per request"
        starts: list[int] = []
        offset = 0
        for n in batch.query_lens:
            starts.append(offset)
            offset += n
        kinds = ("decode", "short", "prefill")
        groups: dict[str, tuple[list[int], list[int], list[int]]] = {kind: ([], [], []) for kind in kinds}
        fresh: list[int] = []
        for start, n, seq_len, slot in zip(starts, batch.query_lens, batch.seq_lens, batch.state_slots):
            assert slot >= 0, "a hybrid request without a state slot"
            g = groups["decode" if n == 1 else "short" if n <= short_max else "prefill"]
            g[0].append(start)
            g[1].append(n)
            g[2].append(slot)
            if seq_len == n:
                fresh.append(slot)

        def segments(kind: str) -> Segments | None:
            s, n, slots = groups[kind]
            return Segments.build(s, n, slots, device) if s else None

        return LinearAttentionPlan(segments("decode"), segments("prefill"), offset, segments("short")), fresh


class TorchLinearAttentionBackend:
    """The torch reference (any device): padded chunked form for long prefill chunks, the recurrence
    for decodes and short rows."""

    name = "torch"

    def __init__(self, pool: StatePool, device: torch.device, short_max: int = SHORT_ROW_MAX) -> None:
        self.pool = pool
        self.device = device
        self.short_max = short_max  # rows of 2..short_max tokens run the recurrence; 0: every row chunked
        self._plan: LinearAttentionPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        self._plan, fresh = LinearAttentionPlan.build(batch, self.device, self.short_max)
        if fresh:
            self.pool.reset(torch.tensor(fresh, dtype=torch.int64, device=self.device))

    def _groups(self) -> list[Segments]:
        assert self._plan is not None, "plan() must run before the forward"
        return [s for s in (self._plan.decode, self._plan.short, self._plan.prefill) if s is not None]

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        states = self.pool.conv[layer]  # [S, C, K-1] float32
        out = torch.empty_like(x)
        for seg in self._groups():  # three groups at most, never one per sequence
            y, new_state = causal_conv1d(x[seg.rows].transpose(1, 2), states[seg.slots], weight, seg.lengths)
            states.index_copy_(0, seg.slots, new_state.float())
            out[seg.flat_rows] = y.transpose(1, 2)[seg.mask]
        return out

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
        states = self.pool.recurrent[layer]  # [S, Hv, Dk, Dv] float32
        plan = self._plan
        assert plan is not None, "plan() must run before the forward"
        out = torch.empty_like(v)
        if plan.decode is not None:
            rows, slots = plan.decode.flat_rows, plan.decode.slots
            o, new_state = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slots])
            states.index_copy_(0, slots, new_state)
            out[rows] = o
        for seg, rule in ((plan.short, sequential_gated_delta_rule), (plan.prefill, chunk_gated_delta_rule)):
            if seg is None:
                continue
            keep = seg.mask[..., None]  # pads: g = 0 and beta = 0 leave the state as it was
            o, new_state = rule(q[seg.rows], k[seg.rows], v[seg.rows], g[seg.rows] * keep, beta[seg.rows] * keep,
                                states[seg.slots])
            states.index_copy_(0, seg.slots, new_state)
            out[seg.flat_rows] = o[seg.mask]
        return out
