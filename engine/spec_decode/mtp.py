"""MTP drafting (Qwen3.5 / Qwen3.6 `mtp.*` head, engine/models/qwen3_5_mtp.py): runs in the model
runner after each target forward and leaves each sampling request's K draft tokens for the next
step's schedule, where `propose` hands them over as the n-gram drafter's are.

After the target forward and sampling of a step:
1. Fill: one MTP forward over every row of the batch, with the batch's own attention plan (same
   positions, block tables, lengths). Row at position p gets the target hidden state at p and the
   embedding of the token at p + 1: the next prompt token, or the token sampled this step, or for a
   verifying request the token it emitted there. Its K/V goes to the MTP layer's own paged cache
   (one extra attention layer, same pages as the target's layers), so the MTP attends to the whole
   context. Rows past a request's last accepted token get a placeholder token: their K/V is
   garbage past num_computed_tokens, rewritten when the next step computes those positions (as the
   target's own rejected K/V is; a hybrid rollback recomputes them too).
2. Draft 1 is the argmax of lm_head over the fill output at the request's last accepted row.
3. Drafts 2..K: one single-row MTP forward per draft and request, one position further each,
   fed the previous draft's token and the previous MTP output (after mtp.norm). These rows write
   K/V past the request's tokens: inside its pages where it holds them, otherwise in scratch pages
   that only the MTP cache has (a few per sequence), overwritten before any real use.

Drafts are greedy (a point mass), so engine/spec_decode/rejection.py verifies them unchanged: the
output distribution stays the target's and a seeded request emits the same tokens.

Drafts are keyed by request id (as vLLM's `update_draft_token_ids`): the scheduler's drafter hook
names the request it drafts for (scheduler/scheduler.py `Drafter`). The drafter also mirrors each
live request's tokens (prompt + emitted), which the fill needs for the token after each row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import kv_cache_shape
from engine.attention.hybrid_backend import HybridBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.models.qwen3_5 import HybridForCausalLM
from engine.models.qwen3_5_mtp import Qwen3_5MTP
from scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class _Live:
    tokens: list[int]  # prompt + every emitted token, as the scheduler has them
    speculative: bool  # the request allows drafts


class MtpDrafter:
    def __init__(
        self,
        model: HybridForCausalLM,
        backend: HybridBackend,
        num_kv_pages: int,
        block_size: int,
        max_num_seqs: int,
        num_speculative_tokens: int,
        max_batch: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        mtp = getattr(model, "mtp", None)
        assert isinstance(mtp, Qwen3_5MTP), "the model was loaded without its MTP head"
        self.model = model
        self.mtp = mtp
        self.backend = backend
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_batch = max_batch
        cfg = model.config
        # Pages 0..num_kv_pages are the pool's (and the graph scratch page); then per drafting
        # request of a step, pages for draft positions past its own pages.
        self.scratch_base = num_kv_pages + 1
        self.scratch_per_seq = -(-num_speculative_tokens // block_size) + 1
        num_pages = self.scratch_base + max_num_seqs * self.scratch_per_seq
        self.kv_cache = torch.zeros(
            kv_cache_shape(num_pages, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device
        )
        self.live: dict[str, _Live] = {}
        # request id -> (its number of tokens when the drafts were made, the drafts)
        self._ready: dict[str, tuple[int, list[int]]] = {}

    @property
    def scratch_nbytes(self) -> int:
        return (self.kv_cache.shape[0] - self.scratch_base) * self.kv_cache[0].nbytes

    # ---- requests (the runner's add/remove) ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: tuple[int, ...], speculative: bool) -> None:
        self.live[request_id] = _Live(list(prompt_token_ids), speculative)

    def remove_request(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    # ---- the scheduler's drafter hook ---------------------------------------------------------------------
    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """The drafts made after the last step for this request; [] when none were (it did not
        sample, or the batch was too large to draft)."""
        made = self._ready.get(request_id)
        # NOTE: drafts follow the tokens the request had when they were made; a request whose
        # length moved since (it cannot, short of a bug) gets none rather than stale ones.
        if made is None or made[0] != len(token_ids):
            return []
        return made[1][:k]

    # ---- after the target forward -----------------------------------------------------------------------
    def step(
        self,
        out: SchedulerOutput,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        emitted: dict[str, list[int]],
        replan: bool,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        """hidden [>= T, hidden]: the target's rows after its final norm; emitted: the tokens each
        sampling request emitted this step; replan: the target ran from a CUDA graph, so the
        attention backend holds no plan for `batch`; skip: requests to fill but not draft for
        (a hybrid rollback recomputes them next step, without drafts)."""
        self._ready = {}
        for rid, toks in emitted.items():
            self.live[rid].tokens.extend(toks)
        next_ids: list[int] = []
        last_rows: list[int] = []
        drafting: list[tuple[ScheduledRequest, int]] = []  # (request, its last accepted position)
        row = 0
        for r in out.requests:
            n = r.num_new_tokens
            tokens = self.live[r.request_id].tokens
            following = tokens[r.start_pos + 1 : r.start_pos + n + 1]
            next_ids.extend(following + [0] * (n - len(following)))  # 0: rows past the accepted ones
            if r.sample and r.request_id not in skip and self.live[r.request_id].speculative:
                accepted = len(emitted[r.request_id]) - 1
                last = n - 1 - r.num_draft_tokens + accepted
                last_rows.append(row + last)
                drafting.append((r, r.start_pos + last))
            row += n
        if len(drafting) > self.max_batch:
            drafting, last_rows = [], []  # fill only: the scheduler will not draft for this batch
        if replan:
            self.backend.attention.plan(batch)
        ids = torch.tensor(next_ids, dtype=torch.int64).to(hidden.device, non_blocking=True)
        h = self.forward(ids, hidden[: len(next_ids)], batch.positions)
        if not drafting:
            return
        h = h[torch.tensor(last_rows, dtype=torch.int64, device=h.device)]
        tok = self.model.compute_logits(h).argmax(dim=-1)  # [B] draft 1
        drafts = [tok]
        for j in range(1, self.k):
            # Draft j + 1 at position P + j: fed draft j and the previous MTP output.
            step = SchedulerOutput(
                requests=tuple(
                    self._draft_row(i, r, pos + j, int(t))
                    for i, ((r, pos), t) in enumerate(zip(drafting, tok.tolist()))
                ),
                finished_request_ids=(),
            )
            draft_batch = build_forward_batch(step, self.block_size, h.device)
            self.backend.attention.plan(draft_batch)
            h = self.forward(tok, h, draft_batch.positions)
            tok = self.model.compute_logits(h).argmax(dim=-1)
            drafts.append(tok)
        table = torch.stack(drafts, dim=1).tolist()  # [B, K]: one host read-back
        for (r, _), d in zip(drafting, table):
            self._ready[r.request_id] = (len(self.live[r.request_id].tokens), d)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The MTP head over rows planned in the attention backend: [T] next tokens, [T, H] hidden."""
        embeds = self.model.embed_tokens(next_ids)
        return self.mtp(embeds, hidden, positions, self.model.rotary, self.kv_cache, self.backend)

    def _draft_row(self, index: int, r: ScheduledRequest, position: int, token: int) -> ScheduledRequest:
        """One draft row of the `index`-th drafting request at `position`: its pages, then scratch
        pages for positions past them."""
        bs = self.block_size
        need = position // bs + 1
        table = r.block_table[:need]
        extra = need - len(table)
        assert extra <= self.scratch_per_seq, f"{r.request_id}: {extra} scratch pages needed"
        base = self.scratch_base + index * self.scratch_per_seq
        return ScheduledRequest(r.request_id, (token,), position, table + tuple(range(base, base + extra)), sample=True)
