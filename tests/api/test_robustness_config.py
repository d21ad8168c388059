"""The robustness flags of `fp4serve serve`: each maps onto its ServerConfig field, --help
explains the overload contract the OpenAI SDK relies on, bad values fail fast naming the flag,
and the API key never shows in a config's repr (so in no log line)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from api.access.limits import RequestLimits
from api.app import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_SHUTDOWN_TIMEOUT_S, ServerConfig
from api.cli import build_parser, main, server_config
from api.server import log_settings
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.front.admission import QueueLimits


def parse(*argv: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", *argv]))


def test_defaults_bound_the_queue_and_each_request() -> None:
    config = parse()
    assert config.queue == QueueLimits(max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS, max_queued_tokens=None)
    assert config.limits == RequestLimits(
        max_n=16, max_output_tokens=None, max_logprobs=20, max_stop=16, max_stop_length=256, max_tools=128
    )
    assert (config.request_timeout_s, config.shutdown_timeout_s) == (None, DEFAULT_SHUTDOWN_TIMEOUT_S)


def test_every_robustness_flag_maps_onto_its_field() -> None:
    config = parse(
        "--max-queued-requests",
        "none",
        "--max-queued-tokens",
        "5000",
        "--max-n",
        "4",
        "--max-output-tokens",
        "256",
        "--max-logprobs",
        "5",
        "--max-stop",
        "2",
        "--max-stop-length",
        "8",
        "--max-tools",
        "3",
        "--request-timeout",
        "30.5",
        "--shutdown-timeout",
        "0",
    )
    assert config.queue == QueueLimits(max_queued_requests=None, max_queued_tokens=5000)
    assert config.limits == RequestLimits(
        max_n=4, max_output_tokens=256, max_logprobs=5, max_stop=2, max_stop_length=8, max_tools=3
    )
    assert (config.request_timeout_s, config.shutdown_timeout_s) == (30.5, 0.0)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-queued-requests", "0"], "--max-queued-requests"),
        (["--max-queued-tokens", "-1"], "--max-queued-tokens"),
        (["--max-n", "0"], "--max-n"),
        (["--max-output-tokens", "0"], "--max-output-tokens"),
        (["--max-logprobs", "21"], "--max-logprobs"),
        (["--max-stop", "-1"], "--max-stop"),
        (["--max-stop-length", "0"], "--max-stop-length"),
        (["--max-tools", "-2"], "--max-tools"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_a_bound_that_is_neither_a_number_nor_none_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--max-queued-requests", "lots"])
    assert info.value.code == 2 and "expected an integer or 'none'" in capsys.readouterr().err


def test_help_documents_the_overload_contract_and_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "Retry-After: 1",
        '"type": "overloaded_error"',
        '"code": "server_overloaded"',
        "the OpenAI SDK retries it",
        "exits with status 1",
        "code request_timeout",
        "x-should-retry: false",
        "code server_stopping",
        f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})",
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S})",
        "--max-n N most choices (n) per prompt (default: 16)",
        "(default: 256)",
        "(default: 128)",
        "A second signal stops the wait at once",
    ):
        assert words in text


def test_the_api_key_is_in_no_repr_and_no_start_up_log_line(caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(engine=EngineConfig(), api_key="sk-do-not-log-9f8e")
    assert "sk-do-not-log-9f8e" not in repr(config) and "sk-do-not-log-9f8e" not in str(config)
    with caplog.at_level(logging.INFO, logger="fp4serve"):
        log_settings(config)
    assert "API key required" in caplog.text and "sk-do-not-log-9f8e" not in caplog.text


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: EngineConfig(max_num_seqs=0), "--max-num-seqs: must be positive, got 0"),
        (lambda: EngineConfig(max_num_batched_tokens=-3), "--max-num-batched-tokens: must be positive, got -3"),
        (lambda: EngineConfig(max_model_len=1), "--max-model-len: must be at least 2, got 1"),
        (lambda: ServerConfig(EngineConfig(), port=65536), "--port: must be in 1..65535, got 65536"),
        (lambda: QueueLimits(max_queued_requests=0), "--max-queued-requests: must be positive, got 0"),
        (lambda: QueueLimits(max_queued_tokens=-1), "--max-queued-tokens: must be positive, got -1"),
        (lambda: RequestLimits(max_n=0), "--max-n: must be positive, got 0"),
        (lambda: RequestLimits(max_tools=-2), "--max-tools: must not be negative, got -2"),
    ],
)
def test_each_config_checks_its_own_bounds_in_the_flags_words(build: Callable[[], object], message: str) -> None:
    # The CLI holds no bounds of its own: the configs raise, with the message `serve` prints.
    with pytest.raises(ConfigError) as refused:
        build()
    assert str(refused.value) == message
