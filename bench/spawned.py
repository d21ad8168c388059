"""A server of our own for the benches: `python -m api.cli serve` on a free port of 127.0.0.1, waited on
until /health says 200, stopped with SIGTERM. Shared by bench soak, bench soak --abuse and bench lm-eval."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve import EndpointError

# The embedded demo model with a small cache and queue, so a soak reaches the limits quickly.
SPAWN_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "64MiB",
    "--max-num-seqs",
    "8",
    "--max-queued-requests",
    "2",
)


class SpawnedServer:
    """`python -m api.cli serve` on a free port of 127.0.0.1 (bench/ drives the server over HTTP
    only; it starts it as any user would)."""

    def __init__(
        self,
        extra_args: list[str],
        start_timeout_s: float = 300.0,
        base_args: tuple[str, ...] = SPAWN_ARGS,
        name: str = "soak",
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        fd, log = tempfile.mkstemp(prefix=f"fp4serve-{name}-", suffix=".log")
        self.log_path = Path(log)
        command = [
            sys.executable,
            "-m",
            "api.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *base_args,
            *extra_args,
        ]
        repo = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen(command, cwd=repo, stdout=fd, stderr=subprocess.STDOUT)
        os.close(fd)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EndpointError(f"the server exited {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise EndpointError(f"the server was not ready after {start_timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
