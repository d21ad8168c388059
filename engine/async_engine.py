"""`AsyncEngine`: what api/ talks to, the front half of the engine in the server's process. It
validates and fans out each request (engine/input_processor.py), hands token ids to the engine
core (in its own process, or on a thread: engine/core_client.py), and turns the core's token ids
back into each request's stream of `RequestOutput`s on the event loop
(engine/output_processor.py). A request arriving during step N joins the batch at step N+1.

It also guards the engine: a bounded waiting queue (engine/admission.py, fed by the core's own
counts, checked where a request enters the engine) and failures: a failed step ends its in-flight
requests with an error and the engine goes on. A lost engine process (crashed, hung, or dead after
failed steps) ends every request it held, and engine/supervisor.py starts a new one, which the
requests arriving meanwhile wait for; when the supervisor gives up, or an in-process engine dies,
the engine is dead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.admission import Admission, QueueLimits
from engine.config import EngineConfig
from engine.core_proc import MAX_CONSECUTIVE_FAILURES
from engine.core_types import EngineCoreOutputs, EngineCoreProtocol, EngineCoreRequest, Owner
from engine.input_processor import child_request_id
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams
from scheduler.scheduler import SchedulerStats

# NOTE: no torch here (EngineCore loads it): api/ imports this module's types and errors at
# start-up, before the model loads, and a test keeps it that way.
if TYPE_CHECKING:
    from engine.core_client import CoreClient, CoreStatus

__all__ = ["MAX_CONSECUTIVE_FAILURES", "AsyncEngine", "EngineDeadError", "EngineRestartingError", "EngineStats"]

logger = logging.getLogger("fp4serve.engine")


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


class EngineRestartingError(RuntimeError):
    """The engine process was lost before the request's first output; a new one is starting, and
    the request may be sent again (it will wait for the new engine)."""


class AsyncEngine:
    def __init__(self, core: EngineCoreProtocol | None = None, client: CoreClient | None = None) -> None:
        """`core`: an EngineCore (or a test's proxy of one) to run on a thread of this process;
        or `client`: a started core elsewhere (engine/core_client.py)."""
        from engine.input_processor import InputProcessor
        from engine.metrics import EngineMetrics
        from engine.output_processor import OutputProcessor
        from engine.tokenizer import Tokenizer

        if client is None:
            from engine.core_client import InprocClient

            assert core is not None, "an EngineCore or a client"
            client = InprocClient(core)
        self.client = client
        self.info = info = client.info
        self.tokenizer = Tokenizer(info.model_path, info.eos_token_ids)
        self.metrics = EngineMetrics(info.model_name, info)
        self.input_processor = InputProcessor(
            info.vocab_size, info.max_model_len, self.tokenizer.eos_token_ids, self.tokenizer
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.admission = Admission(QueueLimits(), info.max_num_seqs)
        # Each request's outputs; an EngineRestartingError when the engine process holding it was lost.
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineRestartingError]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_dead: Callable[[str], None] | None = None
        self._stats = SchedulerStats(0, 0, 0, max(info.num_kv_pages, 1), 0, 0, 0)
        self._num_steps = 0
        self._started = False
        self._stopping = False
        self.dead = False
        self.death_reason: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (blocking: call it from a thread while /health answers 503): in an engine
        process of its own unless `config.engine_process` is off."""
        if config.engine_process:
            from engine.supervisor import EngineSupervisor

            return cls(client=EngineSupervisor(config))
        from engine.core import EngineCore

        return cls(EngineCore(config))

    @property
    def core(self) -> EngineCoreProtocol:
        """The EngineCore, in in-process mode only (tests and debugging)."""
        return self.client.core  # type: ignore[attr-defined]

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping and not self.dead

    def core_status(self) -> CoreStatus:
        """The engine core's process, restarts and state (running, restarting, stopped)."""
        return self.client.status()

    async def start(self, limits: QueueLimits | None = None, on_dead: Callable[[str], None] | None = None,
                    max_output_tokens: int | None = None) -> None:
        """Start the engine loop. `on_dead(reason)` is called (on the loop) if the engine dies;
        `max_output_tokens` caps an absent max_tokens (--max-output-tokens)."""
        assert not self._started, "engine already started"
        self.admission.limits = limits or QueueLimits()
        self.input_processor.max_output_tokens = max_output_tokens
        self._on_dead = on_dead
        self._loop = asyncio.get_running_loop()
        self._started = True
        self.client.start(self._from_core)

    async def shutdown(self) -> None:
        self._stopping = True
        if not self.dead:
            for request_id in list(self._queues):
                await self.abort(request_id)
        if self._started:
            await asyncio.to_thread(self.client.shutdown)

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_queued_tokens=self.admission.num_queued_tokens(),
            num_kv_pages_used=s.num_used_blocks,
            num_kv_pages_total=s.num_blocks,
            prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
        )

    # ---- requests ---------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, owner: Owner = Owner()
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raises ParamError; max_tokens is resolved here), then stream the request's
        outputs. `owner`: who asked (the HTTP request's API key and priority), for fair share.

        The request enters the engine when iteration starts (EngineOverloadedError then, if the
        queue is full) and is aborted, its pages freed, when the consumer stops early (the
        generator's `finally`). A failed request's stream ends with one output carrying `error`.
        """
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.death_reason}")
        children = self.input_processor.process(request_id, prompt_token_ids, params, owner=owner)
        return self._stream(request_id, children)

    async def _stream(self, request_id: str, children: list[EngineCoreRequest]) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.death_reason}")
        assert self._started, "engine not started"
        # NOTE: the check and the sending below run with no await between them, so concurrent
        # arrivals cannot all see the same free room.
        num_prompt_tokens = len(children[0].prompt_token_ids)
        self.admission.admit(len(children), num_prompt_tokens)
        queue: asyncio.Queue[RequestOutput | EngineRestartingError] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request_id, children)
        self.client.add_requests(children)
        self.admission.on_sent(len(children), num_prompt_tokens)
        remaining = len(children)
        started = False
        try:
            while remaining:
                out = await queue.get()
                if isinstance(out, EngineRestartingError):
                    if not started:
                        raise out  # nothing sent yet: the API answers 503 + Retry-After
                    out = RequestOutput(request_id, 0, (), "", "abort", 0, 0, error=str(out))
                started = True
                if out.finish_reason is not None:
                    remaining -= 1
                yield out
                if out.error is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
            if remaining and not self.dead:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """End the request now; the core frees its pages when it reads the abort."""
        outputs, child_ids = self.output_processor.abort(request_id)
        if child_ids and not self.dead:
            self.client.abort_requests(child_ids)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- the core's outputs ---------------------------------------------------------------------------
    def _from_core(self, step: EngineCoreOutputs) -> None:
        """On the core's side (a thread): hand the message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_core_outputs, step)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _on_core_outputs(self, step: EngineCoreOutputs) -> None:
        if self.dead:
            return
        if step.dead is not None:
            if self._stopping:
                pass
            elif step.restart is not None:
                self._core_lost(step.restart, step.dead)
            else:
                self._die(step.dead)
            return
        if step.stats is not None:
            self._stats = step.stats
            self.admission.on_stats(step.stats)
        if step.step_time_s is not None:
            self._num_steps += 1
        if step.error is not None:
            logger.error("engine step failed; failing %d in-flight requests", len(step.failed_request_ids))
        try:
            outputs, finished_by_stop = self.output_processor.process(step)
        except Exception as e:
            logger.critical("output processing crashed", exc_info=e)
            self._die(f"the engine loop crashed ({type(e).__name__})")
            return
        if finished_by_stop:
            self.client.abort_requests(finished_by_stop)
        self._deliver(outputs)

    def _core_lost(self, reason: str, detail: str) -> None:
        """The engine process was lost and a new one is starting (engine/supervisor.py): every
        request it held ends now; those not yet streaming raise EngineRestartingError."""
        self.metrics.engine_restarts.labels(reason=reason).inc()
        error = EngineRestartingError(f"the engine was lost ({detail}) and is restarting; retry the request")
        try:
            outputs = self.output_processor.fail_all(str(error))
        except Exception:
            logger.exception("could not fail the in-flight requests cleanly")
            outputs = []
        logger.error("engine lost (%s: %s): %d in-flight requests failed; a new engine is starting", reason, detail,
                     len(outputs))
        # Some may have gone to the supervisor after the loss, to wait for the new engine: not any more.
        self.client.abort_requests([child_request_id(out.request_id, out.index) for out in outputs])
        self.admission.on_core_lost()
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _die(self, reason: str) -> None:
        """No request can be served any more: every live stream gets an error, now."""
        if self.dead:
            return
        self.dead = True
        self.death_reason = reason
        logger.critical("engine stopped: %s", reason)
        message = f"the engine stopped ({reason}); the server must be restarted"
        try:
            outputs = self.output_processor.fail_all(message)
        except Exception:
            logger.exception("could not fail the in-flight requests cleanly")
            outputs = []
        self._deliver(outputs)
        told = {out.request_id for out in outputs}
        for request_id, queue in self._queues.items():
            if request_id not in told:  # the front's own state may be what broke
                queue.put_nowait(RequestOutput(request_id, 0, (), "", "abort", 0, 0, error=message))
        if self._on_dead is not None:
            self._on_dead(reason)
