"""`AsyncEngine`: what api/ talks to. The step loop is an asyncio task on the server's event
loop: schedule on the loop, forward + sampling in one worker thread (HTTP keeps flowing), then
update request state and hand each request its outputs on its own queue. A request arriving
during step N joins the batch at step N+1.

It also guards the engine: a bounded waiting queue (`QueueLimits`, checked where a request enters
the scheduler) and failures: a failed step ends its in-flight requests with an error and the
engine goes on; repeated failures, or a crash of the loop itself, mark it dead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams

# NOTE: no torch here (EngineCore loads it): api/ imports this module's types and errors at
# start-up, before the model loads, and a test keeps it that way.
if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger("fp4serve.engine")

# Failed steps in a row after which the engine is declared dead: one failure may be a transient
# (an out-of-memory on an odd batch); three in a row mean every batch fails.
MAX_CONSECUTIVE_FAILURES = 3


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on what waits for a batch slot (admitted, not yet running, and beyond the slots the
    next step will fill); None: no bound."""

    max_queued_requests: int | None = None  # each of a request's n samples counts
    max_queued_tokens: int | None = None  # prompt tokens still to compute

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            assert value is None or value >= 1, f"{name} must be positive or None, got {value}"


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_queued_tokens: int  # prompt tokens still to compute beyond the free batch slots (--max-queued-tokens)
    num_kv_pages_used: int
    num_kv_pages_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at a `QueueLimits` bound; the request was not admitted."""


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.info = core.info
        self.metrics = core.metrics
        self.limits = QueueLimits()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4serve-step")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._on_dead: Callable[[str], None] | None = None
        self._num_steps = 0
        self._num_failures = 0  # consecutive failed steps
        self._stopping = False
        self.dead = False
        self.death_reason: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (blocking: call it from a thread while /health answers 503)."""
        from engine.core import EngineCore

        return cls(EngineCore(config))

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping and not self.dead

    async def start(self, limits: QueueLimits | None = None, on_dead: Callable[[str], None] | None = None) -> None:
        """Start the step loop. `on_dead(reason)` is called (on the loop) if the engine dies."""
        assert self._task is None, "engine already started"
        self.limits = limits or QueueLimits()
        self._on_dead = on_dead
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="fp4serve-step-loop")

    async def shutdown(self) -> None:
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if not self.dead:
            for request_id in list(self._queues):
                self._deliver(self.core.abort_request(request_id))
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _free_slots(self) -> int:
        scheduler = self.core.scheduler
        return max(0, scheduler.config.max_num_seqs - len(scheduler.running))

    def num_queued_requests(self, arriving: int = 0) -> int:
        """Requests that will still wait after the next step fills the free batch slots, with
        `arriving` more: a burst at an idle server starts at once, so it is not a queue."""
        return max(0, len(self.core.waiting_requests()) + arriving - self._free_slots())

    def num_queued_tokens(self) -> int:
        """Prompt tokens still to compute of the requests counted by num_queued_requests (the
        scheduler starts the oldest first). O(waiting requests)."""
        waiting = itertools.islice(self.core.waiting_requests(), self._free_slots(), None)
        return sum(r.num_tokens - r.num_computed_tokens for r in waiting)

    def stats(self) -> EngineStats:
        s = self.core.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_queued_tokens=self.num_queued_tokens(),
            num_kv_pages_used=s.num_used_blocks,
            num_kv_pages_total=s.num_blocks,
            prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
        )

    # ---- requests ---------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Validate now (raises ParamError), then stream the request's outputs.

        The request enters the engine when iteration starts (EngineOverloadedError then, if the
        queue is full) and is aborted, its pages freed, when the consumer stops early (the
        generator's `finally`). A failed request's stream ends with one output carrying `error`.
        """
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.death_reason}")
        self.core.validate(prompt_token_ids, params)
        return self._stream(list(prompt_token_ids), params, request_id)

    async def _stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.death_reason}")
        # NOTE: the check and add_request below run with no await between them, so concurrent
        # arrivals cannot all see the same free room.
        self._admit(len(prompt_token_ids), params.n)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        self.core.add_request(request_id, prompt_token_ids, params)
        assert self._wakeup is not None, "engine not started"
        self._wakeup.set()
        remaining = params.n
        try:
            while remaining:
                out = await queue.get()
                if out.finish_reason is not None:
                    remaining -= 1
                yield out
                if out.error is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
            if remaining and not self.dead:
                self.core.abort_request(request_id)

    def _admit(self, num_prompt_tokens: int, n: int) -> None:
        """Raises EngineOverloadedError past a bound. An empty queue takes any request, so none is
        refused merely for being large (api/ bounds n and the prompt length)."""
        queued = self.num_queued_requests()
        if queued == 0:
            return
        max_requests, max_tokens = self.limits.max_queued_requests, self.limits.max_queued_tokens
        if max_requests is not None and self.num_queued_requests(arriving=n) > max_requests:
            raise EngineOverloadedError(
                f"{queued} requests are already waiting for a batch slot (limit {max_requests})"
            )
        if max_tokens is not None:
            queued = self.num_queued_tokens()
            if queued + n * num_prompt_tokens > max_tokens:
                raise EngineOverloadedError(
                    f"{queued} prompt tokens are already waiting for a batch slot (limit {max_tokens})"
                )

    async def abort(self, request_id: str) -> None:
        self._deliver(self.core.abort_request(request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- the step loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            if not self._stopping:
                self._die("the engine loop was cancelled")
            raise
        except Exception as e:
            logger.critical("engine loop crashed", exc_info=e)
            self._die(f"the engine loop crashed ({type(e).__name__})")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while not self._stopping:
            if not self.core.has_unfinished():
                self._wakeup.clear()
                self.metrics.observe_scheduler(self.core.scheduler.stats())
                await self._wakeup.wait()
                continue
            t0 = time.perf_counter()
            out = self.core.schedule()
            if out.is_empty:
                # Everything waits for pages that only an abort can free; let the loop breathe.
                await asyncio.sleep(0.001)
                continue
            try:
                result = await loop.run_in_executor(self._executor, self.core.execute, out)
            except Exception as e:
                if not self._step_failed(e):
                    return
                continue
            self._num_failures = 0
            self._deliver(self.core.process(out, result))
            self._num_steps += 1
            self.metrics.step_time.observe(time.perf_counter() - t0)
            # Yield so HTTP handlers run between steps even when the step was instant.
            await asyncio.sleep(0)

    def _step_failed(self, error: Exception) -> bool:
        """Fail every in-flight request (the batch's KV state is suspect); False once dead."""
        self._num_failures += 1
        logger.error(
            "engine step failed (%d in a row); failing %d in-flight requests",
            self._num_failures, len(self._queues), exc_info=error,
        )
        if self._num_failures >= MAX_CONSECUTIVE_FAILURES:
            self._die(f"{self._num_failures} engine steps failed in a row (last: {type(error).__name__})")
            return False
        # NOTE: clients see the exception's type only; its text (paths, sizes) stays in the log.
        self._deliver(self.core.fail_all(f"the engine failed while running this request ({type(error).__name__}); retry it"))
        return True

    def _die(self, reason: str) -> None:
        """No request can be served any more: every live stream gets an error, now."""
        if self.dead:
            return
        self.dead = True
        self.death_reason = reason
        logger.critical("engine stopped: %s", reason)
        message = f"the engine stopped ({reason}); the server must be restarted"
        try:
            outputs = self.core.fail_all(message)
        except Exception:
            logger.exception("could not fail the in-flight requests cleanly")
            outputs = []
        self._deliver(outputs)
        told = {out.request_id for out in outputs}
        for request_id, queue in self._queues.items():
            if request_id not in told:  # the core's own state may be what broke
                queue.put_nowait(RequestOutput(request_id, 0, (), "", "abort", 0, 0, error=message))
        if self._on_dead is not None:
            self._on_dead(reason)
