"""How many characters one token of this tokenizer can cover at most, so that a prompt too long for
the context is refused from its length alone, before the tokenizer (or the chat template) runs: a
text of C characters has at least C // bound tokens.

Why the bound holds (byte-level BPE, and BPE with byte fallback: Qwen, Llama 3, SmolLM2, Mistral):
such a model has no unknown token, so every token stands for a piece of the normalized text, at
most `longest` UTF-8 bytes long (the longest vocabulary or added token; a Metaspace "▁" or a
"<0x41>" byte token is counted at its own, longer, length). One character is at least one byte,
so the normalized text of N characters has at least N / longest tokens. Normalization can shorten
the text only by composing characters: NFC / NFKC compose at most 4 code points into one (U+1F82,
the longest canonical decomposition in Unicode; compositions are never added to existing sequences),
so N >= C / 4. Hence tokens >= C / (4 * longest) when the normalizer composes, C / longest otherwise.
Any other normalizer or pre-tokenizer that can drop text (Strip, StripAccents, BERT's cleaning,
Replace, a Split that removes its matches, WhitespaceSplit) and any model with an unknown token
(WordLevel, WordPiece, Unigram, BPE without byte fallback) make the count unbounded: then there is
no bound, and only the tokenized length is checked."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import tokenizers

# NFC / NFKC: the most code points one composition replaces (see above).
COMPOSITION_FACTOR = 4
_COMPOSING = frozenset({"NFC", "NFKC"})
_LENGTH_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})  # never shorten a text
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"})


@lru_cache(maxsize=4)  # a tenth of a second over a 150k vocabulary; the loaded tokenizers are shared
def chars_per_token_bound(backend: tokenizers.Tokenizer) -> int | None:
    """The most characters of a prompt one token can stand for, or None when nothing bounds it."""
    model = backend.model
    pre_tokenizers = _flatten(_spec(backend.pre_tokenizer))
    byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    if not isinstance(model, tokenizers.models.BPE) or not (byte_level or model.byte_fallback):
        return None
    if not all(_keeps_text(p) for p in pre_tokenizers):
        return None
    factor = 1
    for normalizer in _flatten(_spec(backend.normalizer)):
        kind = normalizer.get("type")
        if kind in _COMPOSING:
            factor = COMPOSITION_FACTOR
        elif kind not in _LENGTH_KEEPING:
            return None
    # Byte-level pieces spell one byte per character; other pieces are measured in UTF-8 bytes.
    pieces = backend.get_vocab(with_added_tokens=False)
    longest = max((len(p) if byte_level else len(p.encode()) for p in pieces), default=1)
    added = backend.get_added_tokens_decoder().values()
    longest = max([longest, *(len(t.content.encode()) for t in added)])
    return factor * max(longest, 1)


def _spec(component: Any) -> dict[str, Any] | None:
    """A tokenizer component (normalizer, pre-tokenizer) as its JSON spec; None when absent."""
    return None if component is None else json.loads(component.__getstate__())


def _flatten(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as the list of its parts (a Sequence's, or itself)."""
    if not component:
        return []
    parts = component.get("normalizers") or component.get("pretokenizers")
    return [p for part in parts for p in _flatten(part)] if parts is not None else [component]


def _keeps_text(pre_tokenizer: dict[str, Any]) -> bool:
    kind = pre_tokenizer.get("type")
    if kind in ("Split", "Punctuation"):
        return str(pre_tokenizer.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS
