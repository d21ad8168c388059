"""The grammar compiler's tokenizer tables kept on disk (engine/structured_output/compiler.py): a
second build of the same tokenizer reads them back without loading the tokenizer, a changed
tokenizer gets tables of its own, and a damaged file is built again and replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from engine.structured_output import compiler
from tests.factories import write_word_tokenizer

VOCAB = 64
# NOTE: lru_cache's undecorated function: each call below is what a fresh engine process does.
build_tables = compiler._tokenizer_info.__wrapped__


@pytest.fixture()
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint folder's tokenizer files, and a fresh cache root."""
    monkeypatch.setenv("FP4SERVE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    write_word_tokenizer(folder, VOCAB)
    return folder


def tokenizer_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The folders AutoTokenizer loads from, from now on."""
    loads: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def counted(path: str, *args: object, **kwargs: object) -> object:
        loads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return loads


def test_the_tables_are_built_once_then_read_back(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads = tokenizer_loads(monkeypatch)
    built = build_tables(str(folder), VOCAB)
    path = compiler.tables_path(folder, VOCAB)
    assert loads == [str(folder)] and path.is_file()
    again = build_tables(str(folder), VOCAB)
    assert loads == [str(folder)], "the second build loaded the tokenizer again"
    assert again.serialize_json() == built.serialize_json()
    assert again.vocab_size == VOCAB and again.decoded_vocab == built.decoded_vocab
    assert [p.name for p in path.parent.iterdir()] == [path.name], "a staging file was left behind"


def test_another_tokenizer_or_vocabulary_size_gets_tables_of_its_own(folder: Path) -> None:
    first = compiler.tables_path(folder, VOCAB)
    assert compiler.tables_path(folder, VOCAB + 64) != first
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 256}))
    assert compiler.tables_path(folder, VOCAB) != first


def test_damaged_tables_are_built_again_and_replaced(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = build_tables(str(folder), VOCAB).serialize_json()
    path = compiler.tables_path(folder, VOCAB)
    path.write_text(path.read_text()[:100])
    loads = tokenizer_loads(monkeypatch)
    with caplog.at_level("WARNING", logger="fp4serve.structured"):
        assert build_tables(str(folder), VOCAB).serialize_json() == expected
    assert loads == [str(folder)] and "building them again" in caplog.text
    assert path.read_text() == expected


def test_a_cache_that_cannot_be_written_only_costs_the_build(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache root's folder would go")
    monkeypatch.setenv("FP4SERVE_CACHE", str(blocked))
    assert build_tables(str(folder), VOCAB).vocab_size == VOCAB
