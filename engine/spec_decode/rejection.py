"""Verification of draft tokens: which prefix of a request's drafts the target model keeps, and
the one token it adds after it.

A request with drafts d_1..d_k has k + 1 logits rows (after its last real token and after each
draft). Rows are sampled in rounds with the ordinary sampler: round j samples row j of every
request still in play, with that request's processed distribution p_j (grammar mask, penalties,
temperature, top-k/p, min-p, seeded noise keyed on the output position — all exactly as without
speculation). A request stays in play while the token drawn at row j equals d_{j+1}.

Why this is standard speculative rejection sampling: our drafters propose one token (the draft
distribution q is a point mass on d). The rule "accept d with probability min(1, p(d)/q(d)) =
p(d); on rejection draw from normalize(max(p - q, 0))" draws from p restricted to tokens != d.
Drawing x ~ p and accepting iff x == d has the same law: P(accept) = p(d), and given rejection x
is p conditioned on x != d. So every emitted token has exactly the target's distribution; greedy
rows (argmax) keep exactly the non-speculative output, and a seeded request draws the same noise
at the same output position, so it emits the same tokens with or without speculation.

Every drawn token is emitted (the accepted drafts and the first mismatch or the bonus token after
the last draft), so the sampler's and the grammar's per-token state advance only by emitted
tokens and nothing has to be rolled back there."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core_types import SampledToken
from engine.sampler import Sampler
from engine.structured_output.manager import StructuredOutputs


def verify(
    sampler: Sampler,
    structured: StructuredOutputs | None,
    logits: torch.Tensor,
    request_ids: Sequence[str],
    drafts: Sequence[Sequence[int]],
) -> list[tuple[SampledToken, ...]]:
    """logits [sum(len(d) + 1), V]: request i's rows are consecutive, len(drafts[i]) + 1 of them.
    Returns, per request, the tokens it emits this step (1 .. len(drafts[i]) + 1)."""
    starts: list[int] = []
    row = 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    assert logits.shape[0] == row, f"{logits.shape[0]} logits rows for {row} verification positions"
    # NOTE: one sampler call, hence one host read-back, per round (at most max drafts + 1): the
    # price of reusing the sampler as is. A fused verification kernel would need one.
    emitted: list[list[SampledToken]] = [[] for _ in request_ids]
    alive = list(range(len(request_ids)))
    j = 0
    while alive:
        ids = [request_ids[i] for i in alive]
        rows = torch.tensor([starts[i] + j for i in alive], dtype=torch.int64, device=logits.device)
        x = logits if len(alive) == logits.shape[0] else logits[rows]
        grammar_mask = structured.mask(ids, logits.device) if structured is not None else None
        tokens = sampler.sample(x, ids, grammar_mask)
        if grammar_mask is not None and structured is not None:
            structured.accept(ids, [t.token_id for t in tokens])
        still = []
        for i, tok in zip(alive, tokens):
            emitted[i].append(tok)
            if j < len(drafts[i]) and tok.token_id == drafts[i][j]:
                still.append(i)
        alive = still
        j += 1
    return [tuple(e) for e in emitted]
