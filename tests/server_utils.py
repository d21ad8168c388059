"""A real fp4serve server for tests: `python -m api.cli serve ...` as a subprocess on
127.0.0.1 and a free port, ready once /health answers 200, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import openai

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0  # first use builds the demo model and its tokenizer (~15 s); CI is slow
EXIT_USAGE = 2  # what `fp4serve serve` returns for a bad flag or a busy port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        import openai  # lazily: a heavy import that server-less tests never need

        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_openai(self, **kwargs: Any) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; the log is kept only if the exit was unclean."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode


def start_server(*args: str, api_key: str | None = None, timeout: float = START_TIMEOUT_S) -> RunningServer:
    """Start and wait for /health 200; retries when the port was taken between probe and bind."""
    for _ in range(3):
        server = _spawn(args, api_key)
        try:
            _wait_ready(server, timeout)
            return server
        except _PortTaken:
            server.log_path.unlink(missing_ok=True)
            continue
        except BaseException:
            server.stop()
            raise
    raise RuntimeError("could not find a free port for the server")


@contextmanager
def running_server(*args: str, api_key: str | None = None) -> Iterator[RunningServer]:
    server = start_server(*args, api_key=api_key)
    try:
        yield server
    finally:
        server.stop()


class _PortTaken(Exception):
    pass


def _spawn(args: tuple[str, ...], api_key: str | None) -> RunningServer:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="fp4serve-test-", suffix=".log")[1])
    command = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k != "FP4SERVE_API_KEY"}
    if api_key:
        env["FP4SERVE_API_KEY"] = api_key
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return RunningServer(process=process, port=port, log_path=log, api_key=api_key)


def _wait_ready(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            code = server.process.poll()
            if code is not None:
                if code == EXIT_USAGE and "cannot listen" in server.log():
                    raise _PortTaken()
                raise RuntimeError(f"server exited with {code} before it was ready:\n{server.log()[-4000:]}")
            try:
                if client.get(server.url("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
    raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{server.log()[-4000:]}")
