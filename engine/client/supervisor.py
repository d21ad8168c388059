"""`EngineSupervisor`: the keeper of the engine process, in the server's process. It owns the
`MPClient` (engine/client/core_client.py), watches its heartbeat (engine/host/heartbeat.py), and replaces it
when it is lost: the process crashed, hung (a step made no progress for --engine-step-timeout:
the watchdog kills it), or declared itself dead after failed steps.

To the front (engine/front/async_engine.py) it is one CoreClient that never changes. On a loss it sends
`EngineCoreOutputs(dead=..., restart=reason)`, and the front fails every request the lost core
held; requests added from then on wait here and go to the new core once it is ready. The new core
has the same config (weights reloaded, KV pages, state slots and grammar cache fresh) and carries
on from the lost one's last stats: its fair-share counters and its cumulative counters (which the
metrics take increments of). Restarts back off (1 s, 2 s, 4 s, ... up to 30 s); past
--engine-max-restarts failures (losses and failed starts) within --engine-restart-window it gives
up with a plain `dead` message, and the server exits non-zero as it did before restarts existed.

With --data-parallel-size N the server has N supervisors, one per engine core (rank), each on
its own device (engine/client/core_client.py `CoreDevice`): each restarts its core independently, and a
lost core fails only the requests it held (engine/front/async_engine.py). `start_all` loads the N
cores side by side. A core's fair-share view of the others (`update_fair_share`) is kept here and
handed to its successor before the requests that waited.

Threads: each core's reader thread reports its own loss, so one core's losses are serialized;
the watchdog only kills; a restart thread loads the new core. `_lock` guards the client, the
waiting requests and the counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from engine.client.core_client import CoreDevice, CoreStatus, MPClient, OnOutputs, Restart
from engine.config import EngineConfig
from engine.core_types import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from engine.host.heartbeat import HeartbeatReading
from scheduler.fair_queue import FairShareState
from scheduler.output import SchedulerStats

logger = logging.getLogger("fp4serve.engine")

# The first step of a core on a GPU runs cold (Triton compiles its prefill kernels, cuBLAS picks
# its plans), so it gets this many step timeouts. On a CPU the first step is like any other.
FIRST_STEP_FACTOR = 2
KILL_GRACE_S = 1.0  # between the stack dump (SIGUSR1) and SIGKILL, for the dump to reach the log
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # within window_s; 0: none (a lost core stops the server)
    window_s: float = 600.0
    step_timeout_s: float = 60.0  # 0: no watchdog
    start_timeout_s: float = 600.0  # loading a core; 0: no limit
    first_step_factor: float = 1.0  # the first step's allowance, in step timeouts

    @classmethod
    def from_config(cls, config: EngineConfig) -> RestartPolicy:
        return cls(
            config.engine_max_restarts,
            config.engine_restart_window_s,
            config.engine_step_timeout_s,
            config.engine_start_timeout_s,
        )

    def for_device(self, device: str) -> RestartPolicy:
        """The policy for an engine on `device` (EngineInfo.device: "cpu", "cuda:0", ...)."""
        return replace(self, first_step_factor=FIRST_STEP_FACTOR if device.startswith("cuda") else 1.0)

    def backoff_s(self, num_failures: int) -> float:
        """The wait before a restart, after `num_failures` failures in the window (>= 1)."""
        return min(BACKOFF_S * 2 ** (num_failures - 1), MAX_BACKOFF_S)

    def hang(self, beat: HeartbeatReading, last_sent: float, busy: bool, now: float) -> str | None:
        """Why the engine counts as hung, or None. `last_sent`: when it was last handed requests;
        `busy`: its last report had requests in it."""
        timeout = self.step_timeout_s
        if not timeout:
            return None
        if beat.in_step:
            allowance = timeout * (self.first_step_factor if beat.num_steps == 0 else 1)
            stalled = now - beat.step_started
            if stalled <= allowance:
                return None
            return f"a step made no progress for {stalled:.1f} s (limit {allowance:g} s; batch: {beat.shape})"
        if last_sent > beat.alive and now - last_sent > timeout:
            return (
                f"the engine took no new requests for {now - last_sent:.1f} s (limit {timeout:g} s; "
                f"last batch: {beat.shape})"
            )
        if busy and now - beat.alive > timeout:
            return (
                f"the engine loop made no progress for {now - beat.alive:.1f} s with requests in it "
                f"(limit {timeout:g} s; last batch: {beat.shape})"
            )
        return None


class EngineSupervisor:
    """A CoreClient over a replaceable engine process."""

    def __init__(self, config: EngineConfig, policy: RestartPolicy | None = None) -> None:
        """Loads the first core (blocking: call it from a thread); raises what its load raises.
        `config`: with data parallel, the core's own (EngineConfig.for_rank)."""
        self.config = config
        self.policy = policy or RestartPolicy.from_config(config)
        rank = config.data_parallel_rank
        self.device = CoreDevice.for_rank(config, rank) if config.data_parallel_size > 1 else None
        self.name = "engine core" if self.device is None else f"engine core {rank}"  # in log lines
        # Data parallel: the other cores' fair-share charges, as last sent; a new core starts from them.
        self._fair_external: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._loading: MPClient | None = None  # a core being loaded: shutdown kills it
        self._client: MPClient | None = self._load(None)  # None while a restart runs
        self.info: EngineInfo = self._client.info  # type: ignore[assignment]
        self.policy = self.policy.for_device(self.info.device)
        self._generation = 0  # bumped at each loss: a lost core's late messages are dropped
        self._waiting: dict[str, EngineCoreRequest] = {}  # added during a restart, in order
        self._on_outputs: OnOutputs | None = None
        self._last_stats: SchedulerStats | None = None  # the core's last report: its successor carries on
        self._busy = False  # the core's last stats had requests in it
        self._hung: tuple[int, str] | None = None  # (generation, why) of a core the watchdog killed
        self._failures: deque[float] = deque()  # time.monotonic() of each loss or failed start
        self._num_restarts = 0
        self._last_restart: Restart | None = None
        self._gave_up = False
        self._threads: list[threading.Thread] = []

    # ---- CoreClient -----------------------------------------------------------------------------
    def start(self, on_outputs: OnOutputs) -> None:
        assert self._on_outputs is None, "already started"
        assert self._client is not None, "the first core is loaded in __init__"
        self._on_outputs = on_outputs
        self._attach(self._client, self._generation)
        if self.policy.step_timeout_s:
            self._spawn_thread(self._watch, "fp4serve-watchdog")

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        with self._lock:
            if self._client is None:
                self._waiting.update((r.request_id, r) for r in requests)
            else:
                self._client.add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._client is None:
                for request_id in request_ids:
                    self._waiting.pop(request_id, None)
            else:
                self._client.abort_requests(request_ids)

    def update_fair_share(self, external: FairShareState) -> None:
        with self._lock:
            self._fair_external.update(external)
            if self._client is not None:
                self._client.update_fair_share(external)

    def status(self) -> CoreStatus:
        with self._lock:
            client = self._client
            state = "stopped" if self._gave_up or self._stopping.is_set() else "running" if client else "restarting"
            return CoreStatus(state, client.pid if client else None, self._num_restarts, self._last_restart)

    @property
    def fair_share(self) -> FairShareState:
        """The fair-share counters of the core's last report: what its successor starts from."""
        return () if self._last_stats is None else self._last_stats.fair_share

    def shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            client, loading, self._client = self._client, self._loading, None
        if loading is not None:
            loading.kill()
        if client is not None:
            client.shutdown()
        for thread in self._threads:
            thread.join(5)

    # ---- one core ---------------------------------------------------------------------------------
    @classmethod
    def start_all(cls, config: EngineConfig) -> list[EngineSupervisor]:
        """Data parallel: the config.data_parallel_size cores, loaded side by side (blocking). If one
        fails to load, the others are stopped and its error raised."""
        size = config.data_parallel_size
        CoreDevice.for_rank(config, size - 1)  # too few GPUs: say so before loading any core
        with ThreadPoolExecutor(size, thread_name_prefix="fp4serve-load") as pool:
            futures = [pool.submit(cls, config.for_rank(rank)) for rank in range(size)]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is None:
            return [f.result() for f in futures]
        for future, error in zip(futures, errors):
            if error is None:
                future.result().shutdown()
        raise first

    def _load(self, carried: SchedulerStats | None) -> MPClient:
        client = MPClient(self.config, carried, self.device)
        with self._lock:
            self._loading = client
        try:
            client.wait_ready(self.policy.start_timeout_s or None)
        finally:
            with self._lock:
                self._loading = None
        return client

    def _attach(self, client: MPClient, generation: int) -> None:
        self._busy = False
        client.start(partial(self._relay, generation), partial(self._exited, generation))

    def _relay(self, generation: int, outputs: EngineCoreOutputs) -> None:
        """On the core's reader thread: its messages to the front, its death to `_lost`."""
        if generation != self._generation:
            return
        if outputs.dead is not None:  # it gave up on itself (failed steps, a crashed loop) and exits
            self._lost(generation, "error", outputs.dead)
            return
        if outputs.stats is not None:
            self._last_stats = outputs.stats
            self._busy = outputs.stats.num_running + outputs.stats.num_waiting > 0
        assert self._on_outputs is not None
        self._on_outputs(outputs)

    def _exited(self, generation: int, exitcode: int | None) -> None:
        hung = self._hung
        if hung is not None and hung[0] == generation:
            self._lost(generation, "hang", hung[1])
        else:
            self._lost(generation, "crash", f"the engine process exited (exit code {exitcode})")

    def _watch(self) -> None:
        """The watchdog: kill a core whose heartbeat says it hangs; its reader reports the loss."""
        interval = min(1.0, self.policy.step_timeout_s / 10)
        while not self._stopping.wait(interval):
            with self._lock:
                client, generation, busy = self._client, self._generation, self._busy
            if client is None:
                continue
            why = self.policy.hang(client.heartbeat.read(), client.last_sent, busy, time.monotonic())
            if why is None:
                continue
            self._hung = (generation, why)
            logger.error(
                "engine hang: %s; killing the engine process %s (after a dump of its thread stacks, unless it "
                "is stopped)",
                why,
                client.pid,
            )
            client.dump_stacks()
            self._stopping.wait(KILL_GRACE_S)
            client.kill()
            while self._client is client and not self._stopping.wait(interval):
                pass  # until its reader has reported the loss

    # ---- losses and restarts -----------------------------------------------------------------------
    def _lost(self, generation: int, reason: str, detail: str) -> None:
        with self._lock:
            if generation != self._generation or self._stopping.is_set():
                return
            self._generation += 1
            lost, self._client = self._client, None
            num_failures = self._count_failure()
            self._last_restart = Restart(reason, detail, time.time())
        if reason == "error" and lost is not None:
            lost.kill()  # on its way out already; make sure nothing of it runs on
        if num_failures > self.policy.max_restarts:
            self._give_up(detail, num_failures)
            return
        assert self._on_outputs is not None
        self._on_outputs(EngineCoreOutputs(dead=detail, restart=reason))
        delay = self.policy.backoff_s(num_failures)
        logger.info("restarting %s in %g s", "the engine" if self.device is None else self.name, delay)
        self._spawn_thread(partial(self._restart, reason, detail, delay, time.monotonic()), "fp4serve-restart")

    def _restart(self, reason: str, detail: str, delay: float, lost_at: float) -> None:
        """On its own thread: load cores until one starts, or give up."""
        while True:
            if self._stopping.wait(delay):
                return
            try:
                client = self._load(self._last_stats)
                break
            except Exception as e:
                if self._stopping.is_set():
                    return
                with self._lock:
                    num_failures = self._count_failure()
                if num_failures > self.policy.max_restarts:
                    self._give_up(f"the engine failed to start again ({e})", num_failures)
                    return
                delay = self.policy.backoff_s(num_failures)
                logger.error("%s restart failed (%s); trying again in %g s", self.name, e, delay)
        took = time.monotonic() - lost_at
        with self._lock:
            if self._stopping.is_set():
                client.kill()
                return
            self._client = client
            waiting, self._waiting = list(self._waiting.values()), {}
            self._attach(client, self._generation)
            if self._fair_external:  # before the requests: their admission order depends on it
                client.update_fair_share(tuple(self._fair_external.items()))
            if waiting:
                client.add_requests(waiting)
            self._num_restarts += 1
            assert self._last_restart is not None
            self._last_restart = replace(self._last_restart, duration_s=took)
            num_failures = len(self._failures)
        logger.warning(
            "%s restarted after a %s (%s) in %.1f s: restart %d of %d within %g s; engine "
            "process %s, %d waiting requests sent to it",
            self.name,
            reason,
            detail,
            took,
            num_failures,
            self.policy.max_restarts,
            self.policy.window_s,
            client.pid,
            len(waiting),
        )

    def _count_failure(self) -> int:
        """Under the lock: record a failure now; the failures within the window."""
        now = time.monotonic()
        self._failures.append(now)
        while self._failures[0] < now - self.policy.window_s:
            self._failures.popleft()
        return len(self._failures)

    def _give_up(self, detail: str, num_failures: int) -> None:
        p = self.policy
        if p.max_restarts == 0:
            why = f"{detail}; restarts are off (--engine-max-restarts 0)"
        else:
            why = (
                f"{detail}; that is {num_failures} failures within {p.window_s:g} s (--engine-max-restarts "
                f"{p.max_restarts}, --engine-restart-window {p.window_s:g}): not restarting it again"
            )
        with self._lock:
            self._gave_up = True
        assert self._on_outputs is not None
        self._on_outputs(EngineCoreOutputs(dead=why))

    def _spawn_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
