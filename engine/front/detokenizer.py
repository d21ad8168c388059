"""Incremental detokenization of one sample (tokenizers' DecodeStream: correct across UTF-8
characters split over tokens) and stop strings, held back until they can no longer match."""

from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream

# A UTF-8 character has at most 4 bytes, and every token at least one: past 4 tokens with no
# text the bytes are invalid, not incomplete.
_MAX_CHAR_TOKENS = 4


class Detokenizer:
    """Turns a sample's tokens, one step at a time, into text that is safe to show."""

    def __init__(
        self, backend: tokenizers.Tokenizer, stop: tuple[str, ...], skip_special_tokens: bool, include_stop: bool
    ) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._undecoded: list[int] = []  # tokens the stream holds (an incomplete character)
        self._stop = stop
        self._include_stop = include_stop
        # Text that might still be the start of a stop string: at most max(len(stop)) - 1 chars.
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""

    def step(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add new tokens; return (text to emit now, the stop string that matched or None).

        After a match the sample is over: the text up to the stop string (or through it with
        include_stop_str_in_output) is returned and nothing more will be.
        """
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece is None:
                self._undecoded.append(token_id)
                if len(self._undecoded) > _MAX_CHAR_TOKENS:
                    self._pending += self._force_decode()
                continue
            self._undecoded.clear()
            self._pending += piece
        if not self._stop:
            out, self._pending = self._pending, ""
            return out, None
        # NOTE: only `_pending` is searched: emitted text plus the held tail can't hold a match
        # that was missed, because up to len(stop) - 1 chars are always held back.
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self._pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = self._pending[: i + len(s)] if self._include_stop else self._pending[:i]
            self._pending = ""
            return out, s
        cut = max(len(self._pending) - self._hold, 0)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def _force_decode(self) -> str:
        """Bytes that can never form a character: show them as U+FFFD (as `decode` would) and
        restart the stream after them."""
        text = self._backend.decode(self._undecoded, skip_special_tokens=self._skip_special)
        self._undecoded.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        return text

    def flush(self) -> str:
        """The held-back tail, once the sample ended for another reason."""
        out = self._pending + (self._force_decode() if self._undecoded else "")
        self._pending = ""
        return out
