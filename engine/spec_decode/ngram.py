"""Prompt-lookup (n-gram) drafting: find the context's last n tokens earlier in the context and
propose what followed them. No weights; strong where output repeats its input (rewriting a file,
quoting code)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        assert 1 <= ngram_min <= ngram_max, f"bad n-gram range {ngram_min}..{ngram_max}"
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """The scheduler's drafter hook; the context alone decides, whichever request it is."""
        return self.lookup(token_ids, k)

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the context's longest
        matching suffix (n from ngram_max down to ngram_min); [] when no suffix recurs."""
        # NOTE: O(context) numpy work per decoding request and step (vectorised, no Python loop over
        # tokens); an incremental suffix index per request would make it O(1) for long contexts.
        num = len(token_ids)
        if k < 1 or num <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.ngram_max, num - 1), self.ngram_min - 1, -1):
            suffix = tokens[num - n :]  # [n]
            # Windows starting at 0..num-n-1: every n-gram except the suffix itself.
            windows = sliding_window_view(tokens[: num - 1], n)  # [num - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: nearest context, freshest text
                return tokens[start : start + k].tolist()
        return []
