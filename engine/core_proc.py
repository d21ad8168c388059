"""The engine core's busy loop, and the process that runs it (vLLM v1's EngineCoreProc).

The loop applies the front's messages (new requests, aborts, shutdown), steps while anything is
unfinished and emits one `EngineCoreOutputs` per step. With async scheduling (vLLM's
`async_scheduling`, SGLang's overlap loop) one step stays in flight: step n+1 is scheduled and
launched before step n is read back and updated. A failed step ends every live request
with an error and the loop goes on; MAX_CONSECUTIVE_FAILURES in a row, or a crash of the loop
itself, end it with a `dead` message. The same loop runs on a thread of the server's process
(in-process mode) or in a process of its own, behind a pipe (engine/client/core_client.py).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core_types import AbortRequests, AddRequests, EngineCoreOutputs, FairShareUpdate, Shutdown
from engine.errors import ConfigError
from engine.host.allocator import memory_releaser
from engine.host.heartbeat import Heartbeat
from scheduler.output import SchedulerOutput, SchedulerStats

if TYPE_CHECKING:  # NOTE: at run time it would bring torch into the API process before the model loads
    from engine.step_result import PendingStep

logger = logging.getLogger("fp4serve.engine")

# Failed steps in a row after which the engine is declared dead: one failure may be a transient
# (an out-of-memory on an odd batch); three in a row mean every batch fails.
MAX_CONSECUTIVE_FAILURES = 3

Message = AddRequests | AbortRequests | FairShareUpdate | Shutdown


class EngineCoreLoop:
    """Runs on one thread; `core` is an engine.core.EngineCore (or a test's proxy of one)."""

    def __init__(
        self,
        core: Any,
        emit: Callable[[EngineCoreOutputs], None],
        heartbeat: Heartbeat | None = None,
        release_memory: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.emit = emit
        self.heartbeat = heartbeat  # what the server's watchdog reads (engine/client/supervisor.py)
        self.release_memory = release_memory  # run when the loop idles after work (engine/host/allocator.py)
        self.num_failures = 0  # consecutive failed steps
        self._stepped = False  # since the loop last idled
        # Async scheduling: the launched step not yet read back, and when its step began.
        self._in_flight: tuple[SchedulerOutput, PendingStep, float] | None = None

    def run(self, inbox: queue.SimpleQueue[Message]) -> None:
        try:
            self._run(inbox)
        except Exception as e:
            logger.critical("engine loop crashed", exc_info=e)
            try:
                self.core.fail_all()
            except Exception:
                logger.exception("could not end the live requests cleanly")
            self.emit(EngineCoreOutputs(dead=f"the engine loop crashed ({type(e).__name__})"))

    def _run(self, inbox: queue.SimpleQueue[Message]) -> None:
        while True:
            idle = not self.core.has_unfinished()
            if idle and not self.drain():
                return  # a step past every request's end (theirs is dropped), read back before idling
            if idle:  # gauges read zero once drained
                self.emit(EngineCoreOutputs(stats=self.core.scheduler.stats()))
                if self._stepped and self.release_memory is not None:
                    self.release_memory()
                self._stepped = False
            # Block only when there is nothing to step; else take what has arrived and go on.
            messages = [inbox.get()] if idle else []
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            if self.heartbeat is not None:
                self.heartbeat.beat()
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortRequests):
                    self.core.abort_requests(message.request_ids)
                elif isinstance(message, FairShareUpdate):
                    self.core.scheduler.seed_fair_share(message.external)
                else:
                    for request in message.requests:
                        self.core.add_request(request)
            if self.core.has_unfinished() and not self.step():
                return

    def step(self) -> bool:
        """One step, its outputs emitted; False once the engine is dead."""
        if getattr(self.core, "async_scheduling", False):
            return self._step_async()
        t0 = time.perf_counter()
        out = self.core.schedule()
        beat = self.heartbeat
        if out.is_empty:
            # Everything waits for a grammar, or for pages only an abort can free.
            time.sleep(0.001)
            return True
        if beat is not None:
            beat.step_begins(out.requests)
        self._stepped = True
        try:
            result = self.core.execute(out)
        except Exception as e:
            return self._step_failed(e)
        finally:
            if beat is not None:
                beat.step_ends()
        self.num_failures = 0
        outputs = self.core.update(out, result)
        self.emit(replace(outputs, step_time_s=time.perf_counter() - t0))
        return True

    def _step_async(self) -> bool:
        """Schedule and launch step n+1, then read back and update step n (in flight since the last
        call), so the host's work for n+1 overlaps the device's for n. A step that needs step n's
        tokens on the host first (`can_schedule_ahead`) waits for them: the synchronous order."""
        t0 = time.perf_counter()
        if self._in_flight is not None and not self.core.can_schedule_ahead():
            if not self._complete_in_flight():
                return False
            if not self.core.has_unfinished():
                return True
        out = self.core.schedule()
        if out.is_empty:
            if self._in_flight is not None:  # each request waits for its tokens in flight
                return self._complete_in_flight()
            time.sleep(0.001)  # everything waits for a grammar, or for pages only an abort can free
            return True
        beat = self.heartbeat
        if beat is not None:
            beat.step_begins(out.requests)
        self._stepped = True
        previous, self._in_flight = self._in_flight, None
        try:
            pending = self.core.launch(out)
            last = previous[1].result() if previous is not None else None  # the step's one host sync
        except Exception as e:
            return self._step_failed(e)
        finally:
            if beat is not None:
                beat.step_ends()
        self.num_failures = 0
        self._in_flight = (out, pending, t0)
        if previous is not None and last is not None:
            self.emit(replace(self.core.update(previous[0], last), step_time_s=t0 - previous[2]))
        return True

    def drain(self) -> bool:
        """Read back and update the step in flight, if any; False once the engine is dead."""
        return self._in_flight is None or self._complete_in_flight()

    def _complete_in_flight(self) -> bool:
        """Read back and update the step in flight; False once the engine is dead."""
        assert self._in_flight is not None, "no step in flight"
        (out, pending, t0), self._in_flight = self._in_flight, None
        try:
            result = pending.result()
        except Exception as e:
            return self._step_failed(e)
        self.emit(replace(self.core.update(out, result), step_time_s=time.perf_counter() - t0))
        return True

    def _step_failed(self, error: Exception) -> bool:
        """Fail every live request (the batch's KV state is suspect); False once dead."""
        self.num_failures += 1
        logger.error("engine step failed (%d in a row)", self.num_failures, exc_info=error)
        if self.num_failures >= MAX_CONSECUTIVE_FAILURES:
            self.core.fail_all()
            self.emit(
                EngineCoreOutputs(
                    dead=f"{self.num_failures} engine steps failed in a row (last: {type(error).__name__})"
                )
            )
            return False
        failed = self.core.fail_all()
        # NOTE: clients see the exception's type only; its text (paths, sizes) stays in the log.
        message = f"the engine failed while running this request ({type(error).__name__}); retry it"
        self.emit(EngineCoreOutputs(stats=self.core.scheduler.stats(), failed_request_ids=tuple(failed), error=message))
        return True


# ---- the engine process ---------------------------------------------------------------------------
def run_engine_core_proc(
    config: EngineConfig, conn: Connection, heartbeat_slots: Any = None, carried: SchedulerStats | None = None
) -> None:
    """The engine process's main: load, say ready (EngineInfo) or why not, then loop until the
    front says shutdown or goes away (its end of the pipe closes). `heartbeat_slots`: the shared
    array the server's watchdog reads (engine/host/heartbeat.py); `carried`: the last stats of the
    engine this one replaces, whose cumulative and fair-share counters it continues
    (engine/client/supervisor.py)."""
    # NOTE: the front handles SIGINT/SIGTERM and drains; it stops this process through the pipe,
    # so a signal to the whole process group must not kill the engine under in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the front reloads its API keys on SIGHUP (api/access/keys.py)
    # The watchdog sends SIGUSR1 before it kills a hung engine: every thread's stack goes to stderr
    # (the server's log), even from inside a C call that never returns.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # tqdm's default lock (the load's progress bars) also makes a multiprocessing semaphore, which a
    # killed engine leaves to the resource tracker, and the server warns of it at exit: one
    # process, one thread lock is enough.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        from engine.core import EngineCore

        core = EngineCore(config)
        if carried is not None:
            core.scheduler.restore(carried)
    except ConfigError as e:
        conn.send(("failed", "config", str(e)))
        return
    except Exception as e:
        logger.exception("engine start-up failed")
        conn.send(("failed", type(e).__name__, str(e)))
        return
    # The model, its modules and the imports are long-lived: out of the collector's sight, a full
    # collection no longer walks them in the middle of a step (vLLM freezes them the same way).
    gc.collect()
    gc.freeze()
    conn.send(("ready", core.info))
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):  # the front is gone: stop
            inbox.put(Shutdown())

    threading.Thread(target=receive, name="fp4serve-engine-inbox", daemon=True).start()
    lock = threading.Lock()

    def emit(outputs: EngineCoreOutputs) -> None:
        with lock:
            try:
                conn.send(outputs)
            except (BrokenPipeError, OSError):
                pass

    heartbeat = None if heartbeat_slots is None else Heartbeat(heartbeat_slots)
    EngineCoreLoop(core, emit, heartbeat, memory_releaser()).run(inbox)
    core.close()
