"""`AsyncEngine`: what api/ talks to. The step loop is an asyncio task on the server's event
loop: schedule on the loop, forward + sampling in one worker thread (HTTP keeps flowing), then
update request state and hand each request its outputs on its own queue. A request arriving
during step N joins the batch at step N+1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams

logger = logging.getLogger("fp4serve.engine")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_pages_used: int
    num_kv_pages_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.info = core.info
        self.metrics = core.metrics
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4serve-step")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._num_steps = 0
        self._stopping = False
        self.dead = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (blocking: call it from a thread while /health answers 503)."""
        return cls(EngineCore(config))

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    async def start(self) -> None:
        assert self._task is None, "engine already started"
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
        for request_id in list(self._queues):
            self._deliver(self.core.abort_request(request_id))
        self._executor.shutdown(wait=True, cancel_futures=True)

    def stats(self) -> EngineStats:
        s = self.core.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
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

        The request enters the engine when iteration starts and is aborted, its pages freed,
        when the consumer stops early (the generator's `finally`).
        """
        if self.dead:
            raise EngineDeadError("the engine has stopped after a failure")
        self.core.validate(prompt_token_ids, params)
        return self._stream(list(prompt_token_ids), params, request_id)

    async def _stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
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
        finally:
            self._queues.pop(request_id, None)
            if remaining:
                self.core.abort_request(request_id)

    async def abort(self, request_id: str) -> None:
        self._deliver(self.core.abort_request(request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- the step loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
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
            except Exception as e:  # the forward failed: every in-flight request learns of it
                logger.exception("engine step failed; failing %d in-flight requests", len(self._queues))
                self._deliver(self.core.fail_all(f"engine failure: {type(e).__name__}: {e}"))
                continue
            self._deliver(self.core.process(out, result))
            self._num_steps += 1
            self.metrics.step_time.observe(time.perf_counter() - t0)
            # Yield so HTTP handlers run between steps even when the step was instant.
            await asyncio.sleep(0)
