"""How the front reaches the engine core: on a thread of this process (`InprocClient`: tests,
debugging, fault injection) or in a process of its own behind a pipe (`MPClient`, the server's
default), so the forward never shares a GIL with HTTP, JSON, detokenization and the parsers.
Both run engine/core_proc.py's loop and hand each `EngineCoreOutputs` to `on_outputs` on the
core's side (a thread); the caller moves it to its event loop."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from engine.config import ConfigError, EngineConfig
from engine.core_proc import EngineCoreLoop, Message, run_engine_core_proc
from engine.core_types import AbortRequests, AddRequests, EngineCoreOutputs, EngineCoreRequest, EngineInfo, Shutdown

logger = logging.getLogger("fp4serve.engine")

OnOutputs = Callable[[EngineCoreOutputs], None]
SHUTDOWN_TIMEOUT_S = 10.0


class CoreClient(Protocol):
    info: EngineInfo

    def start(self, on_outputs: OnOutputs) -> None: ...
    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def shutdown(self) -> None: ...


class InprocClient:
    """The loop on a thread of this process; `core` is an EngineCore or a test's proxy of one."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.info: EngineInfo = core.info
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_outputs: OnOutputs) -> None:
        assert self._thread is None, "already started"
        loop = EngineCoreLoop(self.core, on_outputs)
        self._thread = threading.Thread(target=loop.run, args=(self._inbox,), name="fp4serve-engine", daemon=True)
        self._thread.start()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._inbox.put(AddRequests(tuple(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.put(AbortRequests(tuple(request_ids)))

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(SHUTDOWN_TIMEOUT_S)


class MPClient:
    """The engine core in a child process (spawned: no inherited threads or CUDA state)."""

    def __init__(self, config: EngineConfig) -> None:
        """Blocking, while the child loads the model: call it from a thread. Raises ConfigError
        (or RuntimeError) with the child's reason when it cannot start."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine_core_proc, args=(config, child_conn), name="fp4serve-engine",
                                 daemon=True)
        self._proc.start()
        child_conn.close()
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})") from None
        if message[0] == "failed":
            self._proc.join(5)
            _, kind, text = message
            raise ConfigError(text) if kind == "config" else RuntimeError(f"{kind}: {text}")
        self.info: EngineInfo = message[1]
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        logger.info("engine core running in process %d", self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self, on_outputs: OnOutputs) -> None:
        def read() -> None:
            try:
                while True:
                    on_outputs(self._conn.recv())
            except (EOFError, OSError):
                pass
            if not self._stopping:
                self._proc.join(1)
                on_outputs(EngineCoreOutputs(dead=f"the engine process exited (exit code {self._proc.exitcode})"))

        self._reader = threading.Thread(target=read, name="fp4serve-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, message: Message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the reader reports the death
                pass

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(tuple(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(tuple(request_ids)))

    def shutdown(self) -> None:
        self._stopping = True
        self._send(Shutdown())
        self._proc.join(SHUTDOWN_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it", SHUTDOWN_TIMEOUT_S)
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
