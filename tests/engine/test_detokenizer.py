"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.front.detokenizer import Detokenizer
from engine.front.tokenizer import _byte_decoder


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per byte (byte-level alphabet): every multi-byte character spans tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 👩‍👩‍👧 and 🇫🇷 flags", "naïve café ñ", "plain ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_text_and_never_split_a_character(byte_tokenizer: Tokenizer, text: str) -> None:
    ids = byte_tokenizer.encode(text).ids
    assert len(ids) == len(text.encode())
    d = Detokenizer(byte_tokenizer, (), skip_special_tokens=True, include_stop=False)
    pieces = [d.step([i])[0] for i in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_over_steps_is_held_back_then_cut(byte_tokenizer: Tokenizer) -> None:
    text = "one two STOP three"
    d = Detokenizer(byte_tokenizer, ("STOP",), skip_special_tokens=True, include_stop=False)
    emitted = []
    for i in byte_tokenizer.encode(text).ids:
        piece, matched = d.step([i])
        emitted.append(piece)
        if matched:
            break
    assert matched == "STOP"
    assert "".join(emitted) == "one two "
    assert not any("S" in p for p in emitted), "a possible stop prefix must never be emitted"


def test_held_text_is_released_once_it_cannot_match(byte_tokenizer: Tokenizer) -> None:
    d = Detokenizer(byte_tokenizer, ("abc",), skip_special_tokens=True, include_stop=False)
    out = "".join(d.step([i])[0] for i in byte_tokenizer.encode("xxabxab").ids)
    assert out == "xxabx"  # "ab" may still become "abc"
    assert d.flush() == "ab"


def test_earliest_of_several_stop_strings_wins(byte_tokenizer: Tokenizer) -> None:
    d = Detokenizer(byte_tokenizer, ("world", "lo w"), skip_special_tokens=True, include_stop=True)
    text, matched = d.step(byte_tokenizer.encode("hello world").ids)
    assert (text, matched) == ("hello w", "lo w")


def test_invalid_utf8_is_shown_as_replacement_characters_not_dropped(byte_tokenizer: Tokenizer) -> None:
    # 0xEF 0xB3 repeated never completes a character; then plain text must still flow.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    byte_char = {b: c for c, b in _byte_decoder().items()}
    bad = [vocab[byte_char[0xEF]], vocab[byte_char[0xB3]]] * 3
    good = byte_tokenizer.encode("ok").ids
    d = Detokenizer(byte_tokenizer, (), skip_special_tokens=True, include_stop=False)
    streamed = "".join(d.step([i])[0] for i in bad + good)
    assert streamed.endswith("ok"), "text after invalid bytes must flow before the end"
    assert "\ufffd" in streamed and streamed.replace("\ufffd", "") == "ok"
    tail = Detokenizer(byte_tokenizer, (), skip_special_tokens=True, include_stop=False)
    assert "".join(tail.step([i])[0] for i in bad[:2]) == ""  # may still complete...
    assert tail.flush() == byte_tokenizer.decode(bad[:2])  # ...until the sample ends
