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

Hybrid prefix caching: a state to keep part way through a request's rows (`ForwardBatch.
interior_saves`) is taken inside the conv and the rule of the request's group and written straight
into the checkpoint pool; no extra pass over the tokens.

CUDA graphs (`prepare_graphs`, `plan_graph`): a captured step has B requests of L rows each (L = 1
for decode, 1 + k for a verify step), so the rows are a plain [B, L] view of the flattened batch
and need no gather, mask or host-built index. The one per-step input is each row's slot, in a
buffer at a fixed address that plan_graph refills (vLLM's and SGLang's state-index buffers); a
padded row holds the pool's scratch slot, so it reads and writes no request's state.

SHORT_ROW_MAX = 16 by measurement (docs/PERF.md, "Short rows"): the chunked form pays for a whole
padded chunk of 64 whatever the row's length, the recurrence pays per token; on tiny test models
they break even near 16 tokens, at Qwen3.5's DeltaNet sizes the recurrence is still far cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    conv_states_at,
    recurrent_gated_delta_rule,
    sequential_gated_delta_rule,
)
from engine.attention.state_pool import StatePool
from engine.batch import ForwardBatch

SHORT_ROW_MAX = 16  # rows of up to this many tokens run the recurrence (see the module docstring)


class LinearAttentionBackend(Protocol):
    name: str

    def plan(self, batch: ForwardBatch) -> None:
        """Per-step segments of the batch; zero the slots of sequences that start now."""

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """SiLU(causal depthwise conv) of x [T, C] with weight [C, K], carrying each sequence's
        conv state in its slot of DeltaNet layer `layer`. Returns [T, C]."""

    def delta_rule(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
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
    # States kept part way: (row, tokens of it done) on the host, and their checkpoint ids [S] int64.
    saves: tuple[tuple[int, int], ...] = ()
    save_ids: torch.Tensor | None = None

    @staticmethod
    def build(
        starts: list[int],
        lengths: list[int],
        slots: list[int],
        device: torch.device,
        saves: list[tuple[int, int, int]] | None = None,
    ) -> Segments:
        """saves: (row, tokens done, checkpoint id) of the states to keep part way."""
        width = max(lengths)
        rows = torch.tensor(
            [[s + min(j, n - 1) for j in range(width)] for s, n in zip(starts, lengths)], dtype=torch.int64
        )
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        save_ids = torch.tensor([c for _, _, c in saves], dtype=torch.int64).to(device) if saves else None
        return Segments(
            rows.to(device),
            mask.to(device),
            torch.tensor(lengths, device=device),
            torch.tensor(slots, dtype=torch.int64, device=device),
            rows[mask].to(device),
            tuple((r, t) for r, t, _ in saves or ()),
            save_ids,
        )


@dataclass(frozen=True)
class LinearAttentionPlan:
    decode: Segments | None  # requests with one new token: L = 1
    prefill: Segments | None  # requests with more than short_max new tokens: the chunked form
    num_tokens: int
    short: Segments | None = None  # requests with 2..short_max new tokens: the recurrence

    @staticmethod
    def build(
        batch: ForwardBatch, device: torch.device, short_max: int = SHORT_ROW_MAX
    ) -> tuple[LinearAttentionPlan, list[int]]:
        """The plan and the slots of sequences starting at position 0 (to be zeroed)."""
        assert len(batch.state_slots) == batch.num_requests, "a hybrid batch needs a state slot per request"
        starts: list[int] = []
        offset = 0
        for n in batch.query_lens:
            starts.append(offset)
            offset += n
        kinds = ("decode", "short", "prefill")
        groups: dict[str, tuple[list[int], list[int], list[int]]] = {kind: ([], [], []) for kind in kinds}
        saves: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in kinds}
        by_request: dict[int, list[tuple[int, int]]] = {}
        for index, done, checkpoint_id in batch.interior_saves:
            by_request.setdefault(index, []).append((done, checkpoint_id))
        fresh: list[int] = []
        for index, (start, n, seq_len, slot) in enumerate(
            zip(starts, batch.query_lens, batch.seq_lens, batch.state_slots)
        ):
            assert slot >= 0, "a hybrid request without a state slot"
            kind = "decode" if n == 1 else "short" if n <= short_max else "prefill"
            g = groups[kind]
            saves[kind].extend((len(g[0]), done, c) for done, c in by_request.get(index, ()))
            g[0].append(start)
            g[1].append(n)
            g[2].append(slot)
            if seq_len == n:
                fresh.append(slot)

        def segments(kind: str) -> Segments | None:
            s, n, slots = groups[kind]
            return Segments.build(s, n, slots, device, saves[kind]) if s else None

        return LinearAttentionPlan(segments("decode"), segments("prefill"), offset, segments("short")), fresh


class TorchLinearAttentionBackend:
    """The torch reference (any device): padded chunked form for long prefill chunks, the recurrence
    for decodes and short rows."""

    name = "torch"

    def __init__(
        self,
        pool: StatePool,
        device: torch.device,
        short_max: int = SHORT_ROW_MAX,
        checkpoints: CheckpointPool | None = None,
    ) -> None:
        self.pool = pool
        self.checkpoints = checkpoints  # hybrid prefix caching: where states kept part way go
        self.device = device
        self.short_max = short_max  # rows of 2..short_max tokens run the recurrence; 0: every row chunked
        self._plan: LinearAttentionPlan | None = None
        # CUDA graphs: each row's slot, at a fixed address; rows [:B] used by a graph of B requests.
        self._graph_slots: torch.Tensor | None = None  # [largest] int64
        self._graph_shape: tuple[int, int] | None = None  # (B, L) of the planned graph step; None: eager

    def plan(self, batch: ForwardBatch) -> None:
        self._graph_shape = None
        self._plan, fresh = LinearAttentionPlan.build(batch, self.device, self.short_max)
        if fresh:
            self.pool.reset(torch.tensor(fresh, dtype=torch.int64, device=self.device))

    # ---- CUDA graphs -------------------------------------------------------------------------
    def prepare_graphs(self, batch_sizes: Sequence[int]) -> None:
        """The slot buffer the captured steps read, sized for the largest batch."""
        # NOTE: kept when already big enough: graphs captured before read its address.
        if self._graph_slots is None or len(self._graph_slots) < max(batch_sizes):
            self._graph_slots = torch.full(
                (max(batch_sizes),), self.pool.scratch_slot, dtype=torch.int64, device=self.device
            )

    def plan_graph(self, batch: ForwardBatch) -> None:
        """Plan a step of B requests with L rows each, padded rows on the scratch slot (outside the
        graph: the slots are copied into the fixed buffer, fresh slots zeroed here)."""
        assert self._graph_slots is not None, "prepare_graphs() first"
        size, length = batch.num_requests, batch.query_lens[0]
        assert all(n == length for n in batch.query_lens), "a graph step has the same rows per request"
        assert len(batch.state_slots) == size, "a hybrid batch needs a state slot per request"
        assert not batch.interior_saves, "states kept part way need the eager plan"
        scratch = self.pool.scratch_slot
        fresh = [s for s, n in zip(batch.state_slots, batch.seq_lens) if n == length and s != scratch]
        if fresh:
            self.pool.reset(torch.tensor(fresh, dtype=torch.int64, device=self.device))
        slots = torch.tensor(batch.state_slots, dtype=torch.int64)
        self._graph_slots[:size].copy_(slots.to(self.device, non_blocking=True))
        self._graph_shape = (size, length)
        self._plan = None

    def _graph_rows(self) -> tuple[int, int, torch.Tensor]:
        assert self._graph_shape is not None and self._graph_slots is not None
        size, length = self._graph_shape
        return size, length, self._graph_slots[:size]

    def _graph_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        size, length, slots = self._graph_rows()
        states = self.pool.conv[layer]  # [S + 1, C, K-1] float32
        lengths = torch.full((size,), length, dtype=torch.int64, device=x.device)  # [B]: a constant of the graph
        y, new_state = causal_conv1d(x.reshape(size, length, -1).transpose(1, 2), states[slots], weight, lengths)
        states.index_copy_(0, slots, new_state.float())
        return y.transpose(1, 2).reshape(size * length, -1)

    def _graph_delta_rule(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        size, length, slots = self._graph_rows()
        states = self.pool.recurrent[layer]  # [S + 1, Hv, Dk, Dv] float32
        o, new_state = self._uniform_rule(
            *(t.reshape(size, length, *t.shape[1:]) for t in (q, k, v, g, beta)), states[slots]
        )
        states.index_copy_(0, slots, new_state.float())
        return o.reshape(size * length, *v.shape[1:])

    def _uniform_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over [B, L] rows with no padding inside them: the recurrence, as the eager
        plan runs decodes and short rows. Returns [B, L, Hv, Dv] and the final states."""
        return sequential_gated_delta_rule(q, k, v, g, beta, state)

    def _groups(self) -> list[Segments]:
        assert self._plan is not None, "plan() must run before the forward"
        return [s for s in (self._plan.decode, self._plan.short, self._plan.prefill) if s is not None]

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._graph_shape is not None:
            return self._graph_conv(layer, x, weight)
        states = self.pool.conv[layer]  # [S, C, K-1] float32
        out = torch.empty_like(x)
        for seg in self._groups():  # three groups at most, never one per sequence
            rows_x, rows_state = x[seg.rows].transpose(1, 2), states[seg.slots]
            if seg.save_ids is not None:  # before the slots are overwritten below
                assert self.checkpoints is not None, "interior saves without a checkpoint pool"
                rows, done = (torch.tensor(v, dtype=torch.int64, device=x.device) for v in zip(*seg.saves))
                self.checkpoints.write(layer, seg.save_ids, conv=conv_states_at(rows_x, rows_state, weight, rows, done))
            y, new_state = causal_conv1d(rows_x, rows_state, weight, seg.lengths)
            states.index_copy_(0, seg.slots, new_state.float())
            out[seg.flat_rows] = y.transpose(1, 2)[seg.mask]
        return out

    def delta_rule(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        if self._graph_shape is not None:
            return self._graph_delta_rule(layer, q, k, v, g, beta)
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
            kept = (
                None
                if seg.save_ids is None
                else torch.empty(len(seg.saves), *states.shape[1:], dtype=torch.float32, device=states.device)
            )
            o, new_state = rule(
                q[seg.rows],
                k[seg.rows],
                v[seg.rows],
                g[seg.rows] * keep,
                beta[seg.rows] * keep,
                states[seg.slots],
                snapshots=seg.saves,
                snapshot_states=kept,
            )
            states.index_copy_(0, seg.slots, new_state)
            if kept is not None and seg.save_ids is not None and self.checkpoints is not None:
                self.checkpoints.write(layer, seg.save_ids, recurrent=kept)
            out[seg.flat_rows] = o[seg.mask]
        return out
