"""The four coding-agent CLIs, run headless against `fp4serve serve --tool-parser auto
--reasoning-parser auto` serving the agent test model (tests/agents/conftest.py), each in a fresh
temp folder and HOME, configured only through its documented env vars and config files
(tests/agents/clis.py). Each must complete one real tool round trip: the model calls the CLI's
file-reading tool, the CLI runs it, the file's unique content comes back to the server in the next
request, and the CLI finishes its turn, with no 4xx/5xx it could not recover from.

The server runs with --api-key, so each CLI's way of sending a key is checked too. Each test
prints the CLI's version, every request's status, and the server's request log lines (prompt,
cached tokens, TTFT): docs/PERF.md records them.

Set FP4SERVE_AGENT_CAPTURE=DIR to write each CLI's first request with tools to DIR/<cli>.json
(to replay one against a server by hand)."""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agents.clis import SETUPS, cli_version
from tests.agents.harness import (
    AgentServer,
    mentions,
    model_requests,
    tool_names,
    unrecovered,
)

RUN_TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 300)]
CAPTURE_ENV = "FP4SERVE_AGENT_CAPTURE"
SHM = "/dev/shm"  # a root outside /tmp, where the working folders are


@dataclass(frozen=True)
class Case:
    """What the user asks each CLI: a call of its own file-reading tool, written out in full (the
    agent test model makes the call it is given, fp4serve_tools/agent_model.py)."""

    cli: str
    tool: str
    arguments: Callable[[Path], dict[str, str]]  # the notes file -> the call's arguments
    outside: bool = False  # the file lives outside the working folder, in a folder of its own


CASES = {
    # Claude Code appends its environment (the working folder) as a system message after the
    # request (folded into the system prompt, where the copy looks last): outside, as for qwen.
    "claude": Case("claude", "Read", lambda f: {"file_path": str(f)}, outside=True),
    "codex": Case("codex", "exec_command", lambda f: {"cmd": f"/bin/cat {f.name}"}),
    # qwen-code sends its working folder and a listing of it in a user message before the request:
    # a path there followed by other tokens than in the call ("project" "/" then "\n", "notes.txt"
    # then "\n") leaves the copy to choose between two matches by recency alone, which fails at
    # some distances. Outside that folder, under a name that shares no token pair with it, the
    # call's path is unlike anything before it.
    "qwen": Case("qwen", "read_file", lambda f: {"file_path": str(f)}, outside=True),
    "opencode": Case("opencode", "read", lambda f: {"filePath": str(f)}),
}


def call_text(name: str, arguments: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run_agent(cli: str, cli_bin: Path, served: AgentServer, tmp_path: Path) -> dict[str, object]:
    """Run one CLI against the server and check the round trip; returns what was seen."""
    case = CASES[cli]
    home = tmp_path / "home"
    home.mkdir()
    # NOTE: short folder names of our own, not pytest's: the model copies the call by 2-grams of
    # tokens, and "/pytest-of-root/pytest-12" repeats one ("/py" "test").
    base = Path(tempfile.mkdtemp(prefix="fp4a-"))
    # Letters only: digits would pair with numbers in the CLIs' prompts ("20 items").
    apart = Path(SHM if Path(SHM).is_dir() else tempfile.gettempdir()) / (
        "agent-notes-" + "".join(random.choices(string.ascii_lowercase, k=10))
    )
    try:
        return _run(case, cli_bin, served, base, apart, home)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(apart, ignore_errors=True)


def _run(case: Case, cli_bin: Path, served: AgentServer, base: Path, apart: Path, home: Path) -> dict[str, object]:
    cli = case.cli
    workdir = base / "project"
    workdir.mkdir()
    notes = (apart if case.outside else workdir) / "notes.txt"
    notes.parent.mkdir(exist_ok=True)
    secret = f"zebra-{uuid.uuid4().hex[:8]}"
    notes.write_text(f"the secret word is {secret}\n")
    prompt = f"Please make this call\n{call_text(case.tool, case.arguments(notes))}"
    served.proxy.clear()
    lines_before = len(served.request_lines())
    run = SETUPS[cli](cli_bin, served.base_url, served.model, workdir, home, prompt)
    done = run.run(RUN_TIMEOUT_S)
    exchanges = served.proxy.snapshot()
    asked = model_requests(exchanges)
    with_tools = [e for e in asked if e.body and e.body.get("tools")]
    seen = {
        "version": cli_version(cli_bin, cli),
        "exit_code": done.returncode,
        "requests": [e.summary() for e in exchanges],
        "log_lines": served.request_lines()[lines_before:],
    }
    _capture(cli, with_tools[0].body if with_tools else None)
    report = (
        f"{cli} exited {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}\n"
        f"requests:\n" + "\n".join(str(s) for s in seen["requests"])
    )
    assert with_tools, f"{cli} sent no request with tools\n{report}"
    assert case.tool in tool_names(with_tools[0].body), report
    assert not unrecovered(exchanges), f"unrecovered failures:\n{report}"
    answered = [e for e in asked if e.status == 200 and mentions(e, secret)]
    assert answered, f"the file's content never reached the server: the tool did not run\n{report}"
    assert done.returncode == 0, report
    print(
        f"\n{cli} {seen['version']}: "
        + "; ".join(seen["requests"])
        + "\n  "
        + "\n  ".join(str(line) for line in seen["log_lines"])
    )
    return seen


def _capture(cli: str, body: object) -> None:
    folder = os.environ.get(CAPTURE_ENV)
    if folder and body is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{cli}.json").write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")


def test_claude_code_completes_a_tool_round_trip(cli_bin: Path, served_agent: AgentServer, tmp_path: Path) -> None:
    run_agent("claude", cli_bin, served_agent, tmp_path)


def test_codex_completes_a_tool_round_trip(cli_bin: Path, served_agent: AgentServer, tmp_path: Path) -> None:
    run_agent("codex", cli_bin, served_agent, tmp_path)


def test_qwen_code_completes_a_tool_round_trip(cli_bin: Path, served_agent: AgentServer, tmp_path: Path) -> None:
    run_agent("qwen", cli_bin, served_agent, tmp_path)


def test_opencode_completes_a_tool_round_trip(cli_bin: Path, served_agent: AgentServer, tmp_path: Path) -> None:
    run_agent("opencode", cli_bin, served_agent, tmp_path)
