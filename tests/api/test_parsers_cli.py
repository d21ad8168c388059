"""`parse-output` as users run it: a subprocess reading a saved model output on stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
            },
        },
    }
]
OUTPUT = (
    "Need the file first.\n</think>\n\nReading it.\n"
    "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/ünï.py\n</parameter>\n"
    "<parameter=max_lines>\n40\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=rm>\n</function>\n</tool_call>"
)
EXPECTED = {
    "content": "Reading it.\n<tool_call>\n<function=rm>\n</function>\n</tool_call>",
    "reasoning_content": "Need the file first.",
    "tool_calls": [
        {
            "id": "call_000000000000000000000000",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "src/ünï.py", "max_lines": 40}'},
        }
    ],
    "finish_reason": "tool_calls",
}


def parse_output(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    cmd = [
        sys.executable, "-m", "api.parsers.parse_output",
        "--tool-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--thinking-in-prompt",
        "--tools", str(tools), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, input=OUTPUT.encode(), capture_output=True, cwd=REPO, timeout=60)


def test_whole_and_streamed_in_chunks_of_three_print_the_same_json(tmp_path: Path) -> None:
    whole = parse_output(tmp_path)
    chunked = parse_output(tmp_path, "--stream-chunk", "3")
    assert whole.returncode == 0 and chunked.returncode == 0, whole.stderr + chunked.stderr
    assert whole.stdout == chunked.stdout
    assert json.loads(whole.stdout) == EXPECTED
    assert b"unknown function 'rm'; kept as content" in whole.stderr


def test_length_finish_is_not_reported_as_tool_calls(tmp_path: Path) -> None:
    done = parse_output(tmp_path, "--finish-reason", "length")
    assert json.loads(done.stdout)["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stream-chunk", "0"], b"--stream-chunk must be at least 1"),
        (["--tool-parser", "mistral"], b"unknown tool parser 'mistral'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path: Path, args: list[str], message: bytes) -> None:
    done = parse_output(tmp_path, *args)
    assert done.returncode == 2
    assert message in done.stderr


def test_the_issue_16_unclosed_call_is_content_not_a_call() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    cmd = [sys.executable, "-m", "api.parsers.parse_output", "--tool-parser", "qwen3", "--finish-reason", "length"]
    done = subprocess.run(cmd, input=text.encode(), capture_output=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "content": text,
        "reasoning_content": None,
        "tool_calls": [],
        "finish_reason": "length",
    }
    assert b"not a call" in done.stderr
