"""Prompt logprobs (`SamplingParams.prompt_logprobs`), computed in the same forward as the prefill:
the hidden state at prompt position p scores the prompt token at p + 1. Requests asking for them
take no prefix-cache hit (the scheduler skips the lookup), so every prompt position is computed.
Token ids and floats only: the output processor (engine/front/output_processor.py) turns them into text."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core_types import PromptLogprobsChunk
from scheduler.output import SchedulerOutput

# Rows scored at once: bounds the [rows, vocab] float32 scratch (256 x 152k vocab = 150 MiB).
_ROWS_PER_CHUNK = 256

# request id -> the prompt positions its rows of this step scored
PromptLogprobsByRequest = dict[str, PromptLogprobsChunk]


class PromptLogprobs:
    """Which running requests want prompt logprobs, and their computation for one step."""

    def __init__(self) -> None:
        self._wanted: dict[str, tuple[tuple[int, ...], int]] = {}  # request id -> (prompt ids, num top)

    def add_request(self, request_id: str, prompt_token_ids: tuple[int, ...] | list[int], num_top: int | None) -> None:
        if num_top is not None:
            self._wanted[request_id] = (tuple(prompt_token_ids), num_top)

    def remove_request(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)

    def compute(
        self, out: SchedulerOutput, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> PromptLogprobsByRequest:
        """`hidden`: [num_tokens, hidden_size], the step's rows in `out.requests` order."""
        if not self._wanted:
            return {}
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # request id, first target position, count, num top
        offset = 0
        for r in out.requests:
            wanted = self._wanted.get(r.request_id)
            if wanted is not None:
                prompt, num_top = wanted
                end = min(r.seq_len, len(prompt) - 1)  # the last prompt position scores no prompt token
                if r.start_pos < end:
                    rows.extend(range(offset, offset + end - r.start_pos))
                    targets.extend(prompt[r.start_pos + 1 : end + 1])
                    spans.append((r.request_id, r.start_pos + 1, end - r.start_pos, num_top))
            offset += r.num_new_tokens
        if not rows:
            return {}
        num_top = max(s[3] for s in spans)
        target_lps, top_ids, top_lps = [], [], []
        for start in range(0, len(rows), _ROWS_PER_CHUNK):
            index = torch.tensor(rows[start : start + _ROWS_PER_CHUNK], device=hidden.device)
            target = torch.tensor(targets[start : start + _ROWS_PER_CHUNK], device=hidden.device)
            logprobs = compute_logits(hidden[index]).float().log_softmax(dim=-1)  # [rows, vocab] float32
            target_lps.append(logprobs.gather(1, target[:, None])[:, 0])
            if num_top:
                values, ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top], descending
                top_lps.append(values)
                top_ids.append(ids)
        lp = torch.cat(target_lps).tolist()
        tids = torch.cat(top_ids).tolist() if num_top else [[] for _ in rows]
        tlps = torch.cat(top_lps).tolist() if num_top else [[] for _ in rows]
        result: PromptLogprobsByRequest = {}
        i = 0
        for request_id, first, count, k in spans:
            span = range(i, i + count)
            result[request_id] = PromptLogprobsChunk(
                start=first,
                logprobs=tuple(lp[j] for j in span),
                top_ids=tuple(tuple(tids[j][:k]) for j in span),
                top_logprobs=tuple(tuple(tlps[j][:k]) for j in span),
            )
            i += count
        return result
