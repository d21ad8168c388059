"""How the single API key reaches the server without showing in `ps`: --api-key-file (the first line
of a file) and $FP4SERVE_API_KEY; --api-key still works and says, in the log, why it should not be
used. A file that cannot be read or holds no key stops the start-up with one line naming the flag."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from api.access.keys import API_KEY_ENV
from api.cli import build_parser, server_config
from engine.errors import ConfigError


def parse(*argv: str) -> str | None:
    return server_config(build_parser().parse_args(["serve", *argv])).api_key


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_key_file_gives_its_first_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with caplog.at_level(logging.WARNING, logger="fp4serve"):
        assert parse("--api-key-file", str(key_file(tmp_path, "  sk-from-file  \nignored\n"))) == "sk-from-file"
    assert not caplog.records
    assert parse() == "from-env"  # no flag: the environment


def test_the_flag_still_works_and_warns_that_ps_shows_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="fp4serve"):
        assert parse("--api-key", "sk-on-the-command-line") == "sk-on-the-command-line"
    [record] = caplog.records
    assert "--api-key-file" in record.getMessage() and API_KEY_ENV in record.getMessage()
    assert "sk-on-the-command-line" not in caplog.text


def test_a_key_file_others_can_read_is_used_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fp4serve"):
        assert parse("--api-key-file", str(key_file(tmp_path, "sk-x\n", mode=0o644))) == "sk-x"
    assert "chmod 600" in caplog.text and "sk-x" not in caplog.text


@pytest.mark.parametrize(("text", "why"), [("", "holds no key"), ("\n\n  \n", "holds no key")])
def test_an_empty_key_file_stops_the_start(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"--api-key-file .*{why}"):
        parse("--api-key-file", str(key_file(tmp_path, text)))


def test_a_missing_key_file_or_both_ways_at_once_stop_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--api-key-file .*No such file"):
        parse("--api-key-file", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="--api-key and --api-key-file: give one"):
        parse("--api-key", "a", "--api-key-file", str(key_file(tmp_path, "b")))
