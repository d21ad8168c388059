"""Hybrid models (Gated DeltaNet): the recurrent state of a request that verifies drafts advances
through every draft, so a rejected draft would leave it past the last accepted token.

We roll back by recompute: the step's verifying requests have their slots' states (conv + recurrent,
all DeltaNet layers) copied before the forward; a request that did not accept all its drafts gets
that copy back, and the scheduler leaves its computed-token count where it was (`rolled_back` in
`Scheduler.update`), so the next step recomputes its last token and the accepted ones as a short
chunk (their K/V is rewritten with the same values) and the state lands exactly on the last
accepted token. A request that accepted every draft keeps the advanced state. The cost of a
rejection is one extra chunk of 2 + accepted tokens in the next step's batch, a short row that the
torch backend runs through the recurrence (engine/attention/linear_attention.py). Per-position states for the
draft window (no recompute) are not kept: they cost K + 1 states per DeltaNet layer per verifying
request (~2 MiB each at Qwen3.5 sizes), and the fla kernels used on GPU do not emit them, so the
runner would need a second rollback path beside this one."""

from __future__ import annotations

import torch

from engine.attention.state_pool import StatePool


class StateSnapshot:
    def __init__(self, pool: StatePool, slots: list[int]) -> None:
        self.pool = pool
        self.slots = slots
        index = torch.tensor(slots, dtype=torch.int64, device=pool.conv.device)
        self.conv = pool.conv.index_select(1, index)  # [layers, S, conv_dim, kernel - 1], a copy
        self.recurrent = pool.recurrent.index_select(1, index)  # [layers, S, Hv, Dk, Dv], a copy

    def restore(self, slots: list[int]) -> None:
        """Put back the saved states of `slots` (a subset of the saved ones)."""
        if not slots:
            return
        rows = torch.tensor([self.slots.index(s) for s in slots], dtype=torch.int64, device=self.conv.device)
        index = torch.tensor(slots, dtype=torch.int64, device=self.conv.device)
        self.pool.conv.index_copy_(1, index, self.conv.index_select(1, rows))
        self.pool.recurrent.index_copy_(1, index, self.recurrent.index_select(1, rows))
