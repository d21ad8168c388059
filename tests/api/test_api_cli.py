"""The `fp4serve` command line: flags map onto EngineConfig / ServerConfig, --help explains
them with defaults, bad values fail fast (before any model loads), and `parse-output` is wired."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from api.app import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from api.cli import build_parser, main, server_config
from engine.config import EngineConfig
from tests.server_utils import REPO

FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--kv-cache-memory",
    "--block-size",
    "--tool-parser",
    "--reasoning-parser",
    "--cors-origins",
    "--log-level",
    "--attention-backend",
    "--no-prefix-caching",
    "--engine-step-timeout",
    "--watchdog-timeout",
    "--engine-start-timeout",
    "--engine-max-restarts",
    "--engine-restart-window",
)


def parse(*argv: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", *argv]))


def test_defaults_map_onto_the_engine_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP4SERVE_API_KEY", raising=False)
    assert parse() == ServerConfig(engine=EngineConfig(), host="127.0.0.1", port=8000)


def test_every_flag_maps_onto_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP4SERVE_API_KEY", raising=False)
    config = parse(
        "--model",
        "/models/qwen",
        "--served-model-name",
        "qwen",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "1024",
        "--kv-cache-memory",
        "2GiB",
        "--block-size",
        "32",
        "--no-prefix-caching",
        "--attention-backend",
        "torch",
        "--device",
        "cpu",
        "--quantization",
        "nvfp4",
        "--seed",
        "5",
        "--in-process-engine",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--api-key",
        "k",
        "--cors-origins",
        "https://a.b, *",
        "--tool-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
        "--max-request-bytes",
        "1024",
    )
    assert config == ServerConfig(
        engine=EngineConfig(
            model="/models/qwen",
            served_model_name="qwen",
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            kv_cache_memory="2GiB",
            block_size=32,
            enable_prefix_caching=False,
            attention_backend="torch",
            device="cpu",
            quantization="nvfp4",
            seed=5,
            engine_process=False,
        ),
        host="0.0.0.0",
        port=9000,
        api_key="k",
        cors_origins=("https://a.b", "*"),
        tool_parser="qwen3_coder",
        reasoning_parser="qwen3",
        max_request_bytes=1024,
    )


def test_supervisor_flags_map_onto_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP4SERVE_API_KEY", raising=False)
    engine = parse(
        "--engine-step-timeout",
        "7.5",
        "--engine-start-timeout",
        "0",
        "--engine-max-restarts",
        "2",
        "--engine-restart-window",
        "30",
    ).engine
    assert (
        engine.engine_step_timeout_s,
        engine.engine_start_timeout_s,
        engine.engine_max_restarts,
        engine.engine_restart_window_s,
    ) == (7.5, 0.0, 2, 30.0)
    assert parse("--watchdog-timeout", "9").engine.engine_step_timeout_s == 9.0  # SGLang's name for it


def test_api_key_comes_from_the_environment_but_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP4SERVE_API_KEY", "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "from-flag").api_key == "from-flag"


def test_help_explains_every_flag_with_its_default_and_never_shows_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FP4SERVE_API_KEY", "sk-secret-in-env")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in text
    for shown in (
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "(default: 128)",
        "(default: 4096)",
        "(default: 16)",
        "(default: auto)",
        "(default: info)",
        f"(default: {DEFAULT_MAX_REQUEST_BYTES})",
    ):
        assert shown in text
    assert "sk-secret-in-env" not in text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "0"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--block-size", "0"], "--block-size"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--tool-parser", "xml"], "--tool-parser"),
        (["--reasoning-parser", "deepseek"], "--reasoning-parser"),
        (["--engine-step-timeout", "-1"], "--engine-step-timeout"),
        (["--engine-max-restarts", "-1"], "--engine-max-restarts"),
        (["--engine-restart-window", "0"], "--engine-restart-window"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_busy_port_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.slow
def test_parse_output_subcommand_is_wired(tmp_path: Path) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(tools))
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    result = subprocess.run(
        [sys.executable, "-m", "api", "parse-output", "--tool-parser", "qwen3", "--tools", str(tools_file)],
        input=text,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert parsed["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert parsed["finish_reason"] == "tool_calls"


def test_speculative_adaptive_is_the_engines_choice_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP4SERVE_API_KEY", raising=False)
    assert parse("--speculative-method", "ngram").engine.speculative_adaptive is None
    assert parse("--speculative-method", "ngram", "--speculative-adaptive").engine.speculative_adaptive is True
    assert parse("--speculative-method", "ngram", "--no-speculative-adaptive").engine.speculative_adaptive is False
