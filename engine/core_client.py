"""How the front reaches the engine core: on a thread of this process (`InprocClient`: tests,
debugging, fault injection) or in a process of its own behind a pipe (`MPClient`, the server's
default, kept and replaced by engine/supervisor.py), so the forward never shares a GIL with HTTP,
JSON, detokenization and the parsers. Both run engine/core_proc.py's loop and hand each
`EngineCoreOutputs` to `on_outputs` on the core's side (a thread); the caller moves it to its
event loop."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from engine.config import ConfigError, EngineConfig
from engine.core_proc import EngineCoreLoop, Message, run_engine_core_proc
from engine.core_types import AbortRequests, AddRequests, EngineCoreOutputs, EngineCoreRequest, EngineInfo, Shutdown
from engine.heartbeat import Heartbeat
from scheduler.scheduler import SchedulerStats

logger = logging.getLogger("fp4serve.engine")

OnOutputs = Callable[[EngineCoreOutputs], None]
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Restart:
    """One replacement of a lost engine core (engine/supervisor.py)."""

    reason: str  # crash | hang | error
    detail: str  # what happened, in words
    at: float  # time.time() when the core was found lost
    duration_s: float | None = None  # until the new core was ready; None while it loads


@dataclass(frozen=True)
class CoreStatus:
    """What /health shows of the engine core."""

    state: Literal["running", "restarting", "stopped"]
    pid: int | None  # the engine process (this process's own in in-process mode)
    num_restarts: int = 0
    last_restart: Restart | None = None


class CoreClient(Protocol):
    info: EngineInfo

    def start(self, on_outputs: OnOutputs) -> None: ...
    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def status(self) -> CoreStatus: ...
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

    def status(self) -> CoreStatus:
        # NOTE: a thread cannot be restarted: a dead in-process engine stops the server (AsyncEngine._die).
        alive = self._thread is not None and self._thread.is_alive()
        return CoreStatus("running" if alive else "stopped", os.getpid())

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(SHUTDOWN_TIMEOUT_S)


class MPClient:
    """The engine core in a child process (spawned: no inherited threads or CUDA state).

    Messages to it leave through a sender thread, so a full pipe (an engine that stopped reading:
    hung, or frozen by SIGSTOP) blocks that thread and never the event loop; the watchdog kills
    such an engine (engine/supervisor.py) and the blocked send then fails."""

    def __init__(self, config: EngineConfig, carried: SchedulerStats | None = None) -> None:
        """Spawns the child and returns; `wait_ready` waits for it to load. `carried`: the last
        stats of the engine it replaces, whose counters its scheduler continues."""
        ctx = multiprocessing.get_context("spawn")
        self.heartbeat = Heartbeat()
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine_core_proc,
                                 args=(config, child_conn, self.heartbeat.slots, carried),
                                 name="fp4serve-engine", daemon=True)
        self._proc.start()
        child_conn.close()
        self.info: EngineInfo | None = None
        self.last_sent = 0.0  # time.monotonic() of the last requests handed to the sender
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._stopping = False

    def wait_ready(self, timeout_s: float | None = None) -> EngineInfo:
        """Blocks while the child loads (call it from a thread). Raises ConfigError (or RuntimeError)
        with the child's reason when it cannot start, or when it is not ready in `timeout_s`."""
        try:
            if not self._conn.poll(timeout_s):
                self.kill()
                raise RuntimeError(f"the engine process did not load in {timeout_s:g} s (--engine-start-timeout)")
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})") from None
        if message[0] == "failed":
            self._proc.join(5)
            _, kind, text = message
            raise ConfigError(text) if kind == "config" else RuntimeError(f"{kind}: {text}")
        self.info = message[1]
        logger.info("engine core running in process %d", self._proc.pid)
        return message[1]

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def start(self, on_outputs: OnOutputs, on_exit: Callable[[int | None], None] | None = None) -> None:
        """Read the core's messages on a thread; when the process ends (unless shut down),
        `on_exit(exit code)`, or without it a `dead` message."""
        assert self.info is not None, "wait_ready first"

        def read() -> None:
            try:
                while True:
                    on_outputs(self._conn.recv())
            except (EOFError, OSError):
                pass
            self._outbox.put(None)  # ends the sender
            if not self._stopping:
                self._proc.join(1)
                if on_exit is not None:
                    on_exit(self._proc.exitcode)
                else:
                    on_outputs(EngineCoreOutputs(dead=f"the engine process exited (exit code {self._proc.exitcode})"))

        def send() -> None:
            while (message := self._outbox.get()) is not None:
                try:
                    self._conn.send(message)
                except (BrokenPipeError, OSError):  # the reader reports the death
                    pass

        self._reader = threading.Thread(target=read, name="fp4serve-engine-reader", daemon=True)
        self._sender = threading.Thread(target=send, name="fp4serve-engine-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.last_sent = time.monotonic()
        self._outbox.put(AddRequests(tuple(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._outbox.put(AbortRequests(tuple(request_ids)))

    def dump_stacks(self) -> None:
        """Every thread's stack to the engine's stderr (its faulthandler; engine/core_proc.py)."""
        try:
            os.kill(self._proc.pid, signal.SIGUSR1)  # type: ignore[arg-type]
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL: nothing of the engine's runs any more; the reader then reports the exit."""
        self._proc.kill()
        self._proc.join(5)

    def shutdown(self) -> None:
        self._stopping = True
        self._outbox.put(Shutdown())
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(SHUTDOWN_TIMEOUT_S)
        self._proc.join(SHUTDOWN_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it", SHUTDOWN_TIMEOUT_S)
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
