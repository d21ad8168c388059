"""How the front reaches the engine core: on a thread of this process (`InprocClient`: tests,
debugging, fault injection) or in a process of its own behind a pipe (`MPClient`, the server's
default, kept and replaced by engine/client/supervisor.py), so the forward never shares a GIL with HTTP,
JSON, detokenization and the parsers. Both run engine/core_proc.py's loop and hand each
`EngineCoreOutputs` to `on_outputs` on the core's side (a thread); the caller moves it to its
event loop.

With --data-parallel-size N each of the N engine processes gets a device of its own before it
loads (`CoreDevice`): on GPUs one each (CUDA_VISIBLE_DEVICES narrowed to the rank's GPU, so every
core sees its own as cuda:0), on CPUs a disjoint 1/N of the CPUs this process may use (pinned with
sched_setaffinity, and as many torch threads), so the cores never compete for a core's caches."""

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

from engine.config import EngineConfig
from engine.core_proc import EngineCoreLoop, Message, run_engine_core_proc
from engine.core_types import (
    AbortRequests,
    AddRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FairShareUpdate,
    Shutdown,
)
from engine.errors import ConfigError
from engine.host.heartbeat import Heartbeat
from scheduler.fair_queue import FairShareState
from scheduler.output import SchedulerStats

logger = logging.getLogger("fp4serve.engine")

OnOutputs = Callable[[EngineCoreOutputs], None]
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Restart:
    """One replacement of a lost engine core (engine/client/supervisor.py)."""

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
    def update_fair_share(self, external: FairShareState) -> None: ...
    def status(self) -> CoreStatus: ...
    def shutdown(self) -> None: ...


# Where NVIDIA's driver lists the GPUs it sees (one folder each): counted without starting CUDA.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class CoreDevice:
    """What one data-parallel engine process may use: a GPU (CUDA_VISIBLE_DEVICES entry; None on
    CPU), the CPUs it is pinned to (empty: not pinned) and its torch threads."""

    rank: int
    gpu: str | None
    cpus: tuple[int, ...]
    num_threads: int

    @staticmethod
    def for_rank(config: EngineConfig, rank: int) -> CoreDevice:
        """Core `rank` of config.data_parallel_size. Raises ConfigError when there are fewer GPUs
        than cores (a core must never fall back to the CPU unnoticed)."""
        size = config.data_parallel_size
        allowed = sorted(os.sched_getaffinity(0))
        per_core = len(allowed) // size
        gpus = visible_gpus() if config.device in ("auto", "cuda") else []
        if gpus:
            if len(gpus) < size:
                raise ConfigError(
                    f"--data-parallel-size {size}: one GPU per engine core, but {len(gpus)} are "
                    f"visible ({', '.join(gpus)})"
                )
            # The GPU feeds itself: threads only for the host-side work, and no pinning (the CPUs
            # nearest each GPU are the platform's business: numactl around the server).
            return CoreDevice(rank, gpus[rank], (), max(1, per_core))
        if per_core == 0:  # more cores than CPUs: share them all, one thread each
            return CoreDevice(rank, None, (), 1)
        return CoreDevice(rank, None, tuple(allowed[rank * per_core : (rank + 1) * per_core]), per_core)

    def describe(self) -> str:
        where = (
            f"GPU {self.gpu}"
            if self.gpu is not None
            else f"CPUs {','.join(map(str, self.cpus))}"
            if self.cpus
            else "every CPU"
        )
        return f"{where}, {self.num_threads} torch thread{'s' if self.num_threads != 1 else ''}"

    def apply(self) -> None:
        """In the engine process, before torch starts CUDA or its thread pool."""
        if self.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.gpu
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        import torch

        torch.set_num_threads(self.num_threads)


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use, as CUDA_VISIBLE_DEVICES entries, found without
    initializing CUDA (a process that has cannot narrow its children's devices any more)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir(NVIDIA_GPUS)))]
    except OSError:
        return []


ENGINE_PROCESS_NAME = "fp4serve-engine"  # each engine process's name; a data-parallel core's adds -<rank>


def kill_loading_engines() -> int:
    """SIGKILL every engine process of this process (the server stopped while they loaded): their
    `wait_ready` then fails at once instead of waiting out the load. How many there were."""
    engines = [p for p in multiprocessing.active_children() if p.name.startswith(ENGINE_PROCESS_NAME)]
    for process in engines:
        process.kill()
    for process in engines:
        process.join(5)
    return len(engines)


def run_pinned_engine_core(
    config: EngineConfig, device: CoreDevice, conn: Any, heartbeat_slots: Any, carried: SchedulerStats | None
) -> None:
    """The main of one data-parallel engine process: its device, then engine/core_proc.py's main."""
    device.apply()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [engine {device.rank}]: %(message)s"
    )
    logger.info("engine core %d of %d: %s", device.rank, config.data_parallel_size, device.describe())
    run_engine_core_proc(config, conn, heartbeat_slots, carried)


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

    def update_fair_share(self, external: FairShareState) -> None:
        self._inbox.put(FairShareUpdate(external))

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
    such an engine (engine/client/supervisor.py) and the blocked send then fails."""

    def __init__(
        self, config: EngineConfig, carried: SchedulerStats | None = None, device: CoreDevice | None = None
    ) -> None:
        """Spawns the child and returns; `wait_ready` waits for it to load. `carried`: the last
        stats of the engine it replaces, whose counters its scheduler continues; `device`: a
        data-parallel core's own device and CPUs."""
        ctx = multiprocessing.get_context("spawn")
        self.heartbeat = Heartbeat()
        self._conn, child_conn = ctx.Pipe()
        if device is None:
            self._proc = ctx.Process(
                target=run_engine_core_proc,
                args=(config, child_conn, self.heartbeat.slots, carried),
                name=ENGINE_PROCESS_NAME,
                daemon=True,
            )
        else:
            self._proc = ctx.Process(
                target=run_pinned_engine_core,
                args=(config, device, child_conn, self.heartbeat.slots, carried),
                name=f"{ENGINE_PROCESS_NAME}-{device.rank}",
                daemon=True,
            )
        self._proc.start()
        child_conn.close()
        self.name = "engine core" if device is None else f"engine core {device.rank}"
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
        logger.info("%s running in process %d", self.name, self._proc.pid)
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

    def update_fair_share(self, external: FairShareState) -> None:
        self._outbox.put(FairShareUpdate(external))

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
