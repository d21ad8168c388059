"""A real fp4serve server for tests: `python -m api.cli serve ...` as a subprocess on
127.0.0.1 and a free port, ready once /health answers 200, stopped with SIGTERM; or the same
`api.server.Server` run in a thread of the test process (`InProcessServer`), for tests that
reach into the engine through its loader (fault injection)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

if TYPE_CHECKING:
    import openai

    from api.app import ServerConfig
    from api.server import Server
    from engine.config import EngineConfig
    from engine.front.async_engine import AsyncEngine

REPO = Path(__file__).resolve().parents[1]
DONE = "[DONE]"
# A wait for /health, not a bound: first use builds the demo model, and on a loaded machine quantizing
# SmolLM2 to NVFP4 at load takes minutes.
START_TIMEOUT_S = 600.0
EXIT_USAGE = 2  # what `fp4serve serve` returns for a bad flag or a busy port


def sse_event(line: str) -> Any | None:
    """The JSON of one `data:` line, DONE for the sentinel, None for anything else."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    return DONE if data == DONE else orjson.loads(data)


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """Status and every event of a streamed POST (a JSON error body counts as one event)."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return response.status_code, [orjson.loads(await response.aread())]
        events = [e async for line in response.aiter_lines() if (e := sse_event(line)) is not None]
    return 200, events


def metric(text: str, name: str, default: float | None = None) -> float:
    """One sample of a Prometheus exposition by its exact name and labels, e.g. `x{reason="a"}`;
    `default` for a labelled sample not yet counted."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    assert default is not None, f"{name} not in /metrics"
    return default


# The one client for tests' polls and probes: httpx.get() builds a TLS context for every call (~30 ms
# of CPU) that plain HTTP to 127.0.0.1 never uses. No kept-alive connections: a server stopped under
# one never leaves it to the next server on its port.
HTTP = httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))

POLL_S = 0.05  # how often a wait below looks again (it waits on the state, not on the interval)


def wait_for(condition: Callable[[], bool], timeout: float, what: Callable[[], str] = lambda: "") -> None:
    """Until `condition()` holds; an AssertionError saying `what()` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting after {timeout:g} s: {what()}"
        time.sleep(POLL_S)


def wait_for_metric(
    base_url: str, name: str, holds: Callable[[float], bool], timeout: float = 30.0, default: float | None = 0.0
) -> float:
    """The sample `name` of the server's /metrics once `holds(value)`."""
    value: list[float] = []

    def read() -> bool:
        value[:] = [metric(HTTP.get(base_url + "/metrics", timeout=10).text, name, default)]
        return holds(value[0])

    wait_for(read, timeout, lambda: f"{name} = {value}")
    return value[0]


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

    def wait_for_log(self, line: str, timeout: float = 10.0) -> None:
        """Until the server has logged `line`."""
        wait_for(lambda: line in self.log(), timeout, lambda: self.log()[-3000:])

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
            time.sleep(POLL_S)
    raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{server.log()[-4000:]}")


class InProcessServer:
    """`api.server.Server` on 127.0.0.1 in a daemon thread with its own event loop. `stop()` does
    what SIGTERM does; `exit_code` is what the process would exit with."""

    def __init__(self, server: Server, port: int) -> None:
        self.server = server
        self.port = port
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fp4serve-in-process", daemon=True)

    def _run(self) -> None:
        try:
            self.exit_code = asyncio.run(self.server.run(handle_signals=False))
        except BaseException as e:  # surfaced by wait_exit / start
            self.error = e

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def engine(self) -> AsyncEngine:
        engine = self.server.state.engine
        assert engine is not None, "the engine has not loaded"
        return engine

    def wait_exit(self, timeout: float) -> int | None:
        self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError("the in-process server crashed") from self.error
        return None if self._thread.is_alive() else self.exit_code

    def stop(self, timeout: float = 20.0) -> int | None:
        if self._thread.is_alive():
            self.server.stop()
        return self.wait_exit(timeout)


def start_in_process(
    config: ServerConfig,
    loader: Callable[[EngineConfig], AsyncEngine] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> InProcessServer:
    """`config`'s host and port are replaced by 127.0.0.1 and a free port."""
    from dataclasses import replace

    from api.app import load_engine
    from api.server import Server

    port = free_port()
    server = Server(replace(config, host="127.0.0.1", port=port), loader or load_engine, log_level="warning")
    running = InProcessServer(server, port)
    running._thread.start()
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not running._thread.is_alive() or server.state.phase == "failed":
                running.stop()
                raise RuntimeError(f"in-process server did not start: {server.state.load_error or running.error}")
            try:
                if client.get(running.url("/health")).status_code == 200:
                    return running
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
    running.stop()
    raise TimeoutError(f"in-process server not ready after {timeout:.0f} s")


@contextmanager
def in_process_server(
    config: ServerConfig, loader: Callable[[EngineConfig], AsyncEngine] | None = None
) -> Iterator[InProcessServer]:
    server = start_in_process(config, loader)
    try:
        yield server
    finally:
        server.stop()
