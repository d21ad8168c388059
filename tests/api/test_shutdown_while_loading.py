"""SIGTERM while the model is still loading: `fp4serve serve` exits within 5 s with status 0, and
leaves no engine process behind. The load is made to never end: the checkpoint's weights file is a
named pipe nobody writes, so opening it blocks (a real checkpoint on a slow disk, without a test
hook in the server)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.server_utils import REPO, free_port, wait_for

pytestmark = pytest.mark.slow
EXIT_WITHIN_S = 5.0
ENGINE_LOADING = "[engine]: grammar cache:"  # the engine process's first line, before it opens the weights


def engine_children(pid: int) -> list[int]:
    """The live child processes of `pid` (the engine processes of a server)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_while_loading_exits_within_5_s(qwen3_ckpt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen3_ckpt, ckpt)
    [weights] = list(ckpt.glob("*.safetensors"))
    weights.unlink()
    os.mkfifo(weights)  # opening it for reading blocks until a writer comes: the load never ends
    log = Path(tempfile.mkstemp(prefix="fp4serve-test-", suffix=".log")[1])
    command = [
        sys.executable,
        "-m",
        "api.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--model",
        str(ckpt),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
    ]
    with log.open("wb") as out:
        server = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    children: list[int] = []
    try:
        wait_for(lambda: ENGINE_LOADING in log.read_text() or server.poll() is not None, 120, log.read_text)
        assert server.poll() is None, log.read_text()
        children = engine_children(server.pid)
        assert children, "no engine process"
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = server.wait(60)
        took = time.monotonic() - signalled
        text = log.read_text()
        assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGTERM:\n{text[-3000:]}"
        assert code == 0, text[-3000:]
        assert "stopped while loading: killed 1 engine process being loaded" in text, text[-3000:]
        assert not [
            pid
            for pid in children
            if Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        ], "an engine was left"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        for pid in children:  # an engine left blocked on the pipe: unblock and end it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.unlink(missing_ok=True)
