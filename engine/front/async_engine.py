"""`AsyncEngine`: what api/ talks to, the front half of the engine in the server's process. It
validates and fans out each request (engine/front/input_processor.py), hands token ids to the engine
core (in its own process, or on a thread: engine/client/core_client.py), and turns the core's token ids
back into each request's stream of `RequestOutput`s on the event loop
(engine/front/output_processor.py). A request arriving during step N joins the batch at step N+1.

It also guards the engine: a bounded waiting queue (engine/front/admission.py, fed by the core's own
counts, checked where a request enters the engine) and failures: a failed step ends its in-flight
requests with an error and the engine goes on. A lost engine process (crashed, hung, or dead after
failed steps) ends every request it held, and engine/client/supervisor.py starts a new one, which the
requests arriving meanwhile wait for; when the supervisor gives up, or an in-process engine dies,
the engine is dead.

Data parallel (--data-parallel-size N): N engine cores, each with its own client (a supervisor),
behind this one front. Each request, all its samples together, goes to the core
engine/client/core_router.py picks (best cached prefix, then least load; engine/client/placement.py), which
also keeps fair share global (engine/client/global_fair_share.py); admission counts every core
(engine/front/admission.py). A lost core ends only the requests it held, and new ones go to the others
while it restarts; a core whose supervisor gives up makes the engine dead, as with one core. With
one core there is no router and every request goes to core 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from engine.client.core_router import CoreRouter
from engine.config import EngineConfig
from engine.core_proc import MAX_CONSECUTIVE_FAILURES
from engine.core_types import (
    EngineCoreOutputs,
    EngineCoreProtocol,
    EngineCoreRequest,
    Owner,
)
from engine.front.admission import Admission, QueueLimits
from engine.front.outputs import RequestOutput
from scheduler.output import SchedulerStats
from scheduler.request import SamplingParams

# NOTE: no torch here (EngineCore loads it): api/ imports this module's types and errors at
# start-up, before the model loads, and a test keeps it that way.
if TYPE_CHECKING:
    from engine.client.core_client import CoreClient, CoreStatus

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
    def __init__(
        self,
        core: EngineCoreProtocol | None = None,
        client: CoreClient | None = None,
        clients: Sequence[CoreClient] | None = None,
    ) -> None:
        """`core`: an EngineCore (or a test's proxy of one) to run on a thread of this process;
        or `client`: a started core elsewhere (engine/client/core_client.py); or `clients`: data
        parallel, one per engine core, in rank order."""
        from engine.front.input_processor import InputProcessor
        from engine.front.metrics import EngineMetrics
        from engine.front.output_processor import OutputProcessor
        from engine.front.tokenizer import Tokenizer

        if clients is None:
            if client is None:
                from engine.client.core_client import InprocClient

                assert core is not None, "an EngineCore or a client"
                client = InprocClient(core)
            clients = [client]
        self.clients = list(clients)
        n = len(self.clients)
        self.info = info = self.clients[0].info
        self.tokenizer = Tokenizer(info.model_path, info.eos_token_ids)
        self.metrics = EngineMetrics(info.model_name, info, n)
        self.input_processor = InputProcessor(
            info.vocab_size, info.max_model_len, self.tokenizer.eos_token_ids, self.tokenizer
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.admission = Admission(QueueLimits(), info.max_num_seqs, n)
        self.router = CoreRouter(self.clients, info.max_num_seqs) if n > 1 else None  # data parallel only
        # Each request's outputs; an EngineRestartingError when the engine process holding it was lost.
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineRestartingError]] = {}
        self._core_of: dict[str, tuple[int, tuple[str, ...]]] = {}  # request id -> its core, its samples' ids
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_dead: Callable[[str], None] | None = None
        self._stats = [SchedulerStats(0, 0, 0, max(info.num_kv_pages, 1), 0, 0, 0)] * n  # each core's last report
        self._num_steps = 0
        self._started = False
        self._stopping = False
        self.dead = False
        self.death_reason: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (blocking: call it from a thread while /health answers 503): in an engine
        process of its own unless `config.engine_process` is off; --data-parallel-size of them."""
        size = config.data_parallel_size
        if config.engine_process:
            from engine.client.supervisor import EngineSupervisor

            return (
                cls(client=EngineSupervisor(config)) if size == 1 else cls(clients=EngineSupervisor.start_all(config))
            )
        from engine.core import EngineCore

        if size == 1:
            return cls(EngineCore(config))
        from engine.client.core_client import InprocClient

        return cls(clients=[InprocClient(EngineCore(config.for_rank(rank))) for rank in range(size)])

    @staticmethod
    def abandon_loads() -> int:
        """The server stops while `from_config` loads: kill the engine processes being loaded, so
        the load fails now rather than after the model is in. How many were killed."""
        from engine.client.core_client import kill_loading_engines

        return kill_loading_engines()

    @property
    def client(self) -> CoreClient:
        """The engine core's client (with data parallel, core 0's)."""
        return self.clients[0]

    @property
    def core(self) -> EngineCoreProtocol:
        """The EngineCore, in in-process mode only (tests and debugging; core 0's with data parallel)."""
        return self.client.core  # type: ignore[attr-defined]

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping and not self.dead

    def core_status(self) -> CoreStatus:
        """The engine core's process, restarts and state (running, restarting, stopped); core 0's."""
        return self.client.status()

    def core_statuses(self) -> list[CoreStatus]:
        """Each engine core's, in rank order."""
        return [client.status() for client in self.clients]

    async def start(
        self,
        limits: QueueLimits | None = None,
        on_dead: Callable[[str], None] | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        """Start the engine loop. `on_dead(reason)` is called (on the loop) if the engine dies;
        `max_output_tokens` caps an absent max_tokens (--max-output-tokens)."""
        assert not self._started, "engine already started"
        self.admission.limits = limits or QueueLimits()
        self.input_processor.max_output_tokens = max_output_tokens
        self._on_dead = on_dead
        self._loop = asyncio.get_running_loop()
        self._started = True
        for index, client in enumerate(self.clients):
            client.start(partial(self._from_core, index=index))

    async def shutdown(self) -> None:
        self._stopping = True
        if not self.dead:
            for request_id in list(self._queues):
                await self.abort(request_id)
        if self._started:
            await asyncio.gather(*(asyncio.to_thread(client.shutdown) for client in self.clients))

    def stats(self) -> EngineStats:
        """Summed over the engine cores."""
        every = self._stats
        return EngineStats(
            num_running=sum(s.num_running for s in every),
            num_waiting=sum(s.num_waiting for s in every),
            num_queued_tokens=self.admission.num_queued_tokens(),
            num_kv_pages_used=sum(s.num_used_blocks for s in every),
            num_kv_pages_total=sum(s.num_blocks for s in every),
            prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in every),
            prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in every),
            num_preemptions=sum(s.num_preemptions for s in every),
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
        core = 0 if self.router is None else self.router.place(request_id, children, self.admission.loads())
        queue: asyncio.Queue[RequestOutput | EngineRestartingError] = asyncio.Queue()
        self._queues[request_id] = queue
        self._core_of[request_id] = (core, tuple(child.request_id for child in children))
        self.output_processor.add_request(request_id, children, core)
        self.clients[core].add_requests(children)
        self.admission.on_sent(len(children), num_prompt_tokens, core)
        remaining = len(children)
        started = False
        try:
            while remaining:
                out = await queue.get()
                if isinstance(out, EngineRestartingError):
                    if not started:
                        raise out  # nothing sent yet: the API answers 503 + Retry-After
                    out = RequestOutput(request_id, 0, (), "", "abort", 0, 0, error=str(out), restarting=True)
                if not started and self.router is not None:
                    self.router.started(request_id)
                started = True
                if out.finish_reason is not None:
                    remaining -= 1
                yield out
                if out.error is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
            if self.router is not None:
                self.router.started(request_id)
            if remaining and not self.dead:
                await self.abort(request_id)
            self._core_of.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """End the request now; the core frees its pages when it reads the abort."""
        outputs, child_ids = self.output_processor.abort(request_id)
        if child_ids and not self.dead:
            core, _ = self._core_of.get(request_id, (0, ()))
            self.clients[core].abort_requests(child_ids)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- the core's outputs ---------------------------------------------------------------------------
    def _from_core(self, step: EngineCoreOutputs, index: int = 0) -> None:
        """On engine core `index`'s side (a thread): hand its message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_core_outputs, step, index)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _on_core_outputs(self, step: EngineCoreOutputs, index: int) -> None:
        if self.dead:
            return
        if step.dead is not None:
            if self._stopping:
                pass
            elif step.restart is not None:
                self._core_lost(index, step.restart, step.dead)
            else:
                self._die(step.dead)
            return
        if step.stats is not None:
            self._stats[index] = step.stats
            self.admission.on_stats(step.stats, index)
        if self.router is not None:
            self.router.on_report(index, step, self._stats)
        if step.step_time_s is not None:
            self._num_steps += 1
        if step.error is not None:
            logger.error("the engine ended %d requests with an error: %s", len(step.failed_request_ids), step.error)
        try:
            outputs, finished_by_stop = self.output_processor.process(step, index)
        except Exception as e:
            logger.critical("output processing crashed", exc_info=e)
            self._die(f"the engine loop crashed ({type(e).__name__})")
            return
        if finished_by_stop:
            self.clients[index].abort_requests(finished_by_stop)
        self._deliver(outputs)

    def _core_lost(self, index: int, reason: str, detail: str) -> None:
        """An engine process was lost and a new one is starting (engine/client/supervisor.py): every
        request it held ends now; those not yet streaming raise EngineRestartingError."""
        self.metrics.engine_restarts.labels(reason=reason).inc()
        self.metrics.on_core_lost(index)
        what = "engine" if len(self.clients) == 1 else f"engine core {index}"
        error = EngineRestartingError(f"the {what} was lost ({detail}) and is restarting; retry the request")
        lost = [request_id for request_id, (core, _) in self._core_of.items() if core == index]
        child_ids = [child_id for request_id in lost for child_id in self._core_of[request_id][1]]
        try:
            outputs = self.output_processor.fail(child_ids, str(error))
        except Exception:
            logger.exception("could not fail the in-flight requests cleanly")
            outputs = []
        logger.error(
            "%s lost (%s: %s): %d in-flight requests failed; a new %s is starting",
            what,
            reason,
            detail,
            len(outputs),
            what.removesuffix(f" {index}"),
        )
        # Some may have gone to the supervisor after the loss, to wait for the new engine: not any more.
        self.clients[index].abort_requests(child_ids)
        self.admission.on_core_lost(index)
        if self.router is not None:
            self.router.on_core_lost(index)
        for request_id in lost:
            if (queue := self._queues.get(request_id)) is not None:
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
