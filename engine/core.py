"""The engine core: scheduler + model runner, speaking token ids only. Each step is schedule ->
execute -> update and returns every scheduled request's new token ids, logprob ids and finish
reason, and prompt logprobs as ids and floats (`EngineCoreOutputs`). Text, stop strings, n > 1 and
per-request metrics live in the
front (engine/front/input_processor.py, engine/front/output_processor.py); the core runs in its own process
(engine/core_proc.py) or on a thread of the server's (engine/client/core_client.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.attention.host_pool import host_tier_fields
from engine.config import EngineConfig
from engine.core_types import (
    VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    PromptLogprobsChunk,
    SampledToken,
)
from engine.errors import ConfigError
from engine.model_runner import ModelRunner
from engine.spec_decode.config import DEFAULT_MAX_BATCH, SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.step_result import PendingStep, StepResult
from engine.structured_output.grammar_cache import DEFAULT_COMPILE_WORKERS
from engine.structured_output.manager import StructuredOutputs
from engine.weights.config.generation_config import generation_defaults
from engine.weights.config.model_config import ModelConfig
from engine.weights.model_path import default_model_name, resolve_model_path
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Drafter, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from engine.cache_events.kv_events import KVEvents
    from engine.cache_events.prefix_cache_feed import PrefixCacheFeed

__all__ = ["VERSION", "EngineCore", "EngineInfo", "resolve_model_path"]

logger = logging.getLogger("fp4serve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path, is_demo = resolve_model_path(config)
        self.model_config = ModelConfig.from_checkpoint(path)
        mc = self.model_config
        sampling_defaults = generation_defaults(config.generation_config, path)  # a bad file fails before the load
        max_model_len = config.max_model_len or mc.max_position_embeddings
        self.structured = StructuredOutputs(path, mc.vocab_size, config.grammar_cache_bytes)
        self.structured.start()  # the grammar compiler's tokenizer tables, built while the model loads
        logger.info(
            "grammar cache: compiled grammars kept up to %.0f MiB (--grammar-cache-bytes), least recently "
            "used out; %d compile threads, each API key compiling one grammar at a time",
            config.grammar_cache_bytes / (1 << 20),
            DEFAULT_COMPILE_WORKERS,
        )
        self.speculative = self._speculative_config(config, mc)  # before the runner: MTP changes what it loads
        self.kv_events = self._kv_events(config)  # before the model loads: a taken port fails start-up at once
        spec = self.speculative
        self.runner = ModelRunner(path, mc, config, max_model_len, self.structured)
        capacity = self.runner.num_kv_pages * config.block_size
        if max_model_len > capacity:
            logger.warning("max_model_len %d > KV capacity %d tokens: lowered to %d", max_model_len, capacity, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                block_size=config.block_size,
                num_blocks=self.runner.num_kv_pages,
                # Hybrid models: only with state checkpoints (the runner logs their budget).
                enable_prefix_caching=config.enable_prefix_caching
                and (mc.hybrid is None or self.runner.num_state_checkpoints > 0),
                num_state_slots=self.runner.num_state_slots,
                num_state_checkpoints=self.runner.num_state_checkpoints,
                state_checkpoint_bits=self.runner.state_checkpoint_bits,
                scheduling_policy=config.scheduling_policy,  # type: ignore[arg-type]
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                speculative_max_batch=spec.max_batch if spec else 0,
                speculative_adaptive=config.speculative_adaptive
                if config.speculative_adaptive is not None
                else self.runner.device.type == "cpu",
                **host_tier_fields(self.runner.host_pool),
            ),
            drafter=self._drafter(spec),
        )
        if self.kv_events is not None:
            self.scheduler.block_manager.event_sink = self.kv_events.recorder
            if self.scheduler.checkpoints is not None:  # a hybrid: only pages a state snapshot needs are told
                from engine.cache_events.snapshot_gate import SnapshotGate

                gate = SnapshotGate(self.kv_events.recorder)
                self.scheduler.block_manager.event_sink = gate
                self.scheduler.checkpoints.page_sink = gate
            self.kv_events.started()
            if not self.scheduler.config.enable_prefix_caching:
                logger.warning(
                    "KV events: prefix caching is off, so no page ever enters the cache and no "
                    "BlockStored event will be sent"
                )
        # Data parallel: the front places requests by what each core caches (engine/client/placement.py).
        self.prefix_feed: PrefixCacheFeed | None = None
        if config.data_parallel_size > 1 and self.scheduler.config.enable_prefix_caching:
            from engine.cache_events.prefix_cache_feed import PrefixCacheFeed

            self.prefix_feed = PrefixCacheFeed(self.scheduler.block_manager.event_sink)
            self.scheduler.block_manager.event_sink = self.prefix_feed
        if self.scheduler.host is not None:  # KV events of the host tier (medium "CPU"), placement's feed
            self.scheduler.host.event_sink = self.scheduler.block_manager.event_sink
        self.async_scheduling = self._async_scheduling(config, mc)
        if mc.hybrid is not None and not self.scheduler.config.enable_prefix_caching:
            logger.info(
                "prefix caching off for %s (a hybrid model): %s",
                mc.architecture,
                "--no-prefix-caching" if not config.enable_prefix_caching else "--num-state-checkpoints 0",
            )
        self.info = EngineInfo(
            model_name=config.served_model_name or default_model_name(config),
            model_path=str(path),
            is_demo=is_demo,
            architecture=mc.architecture,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            attention_backend=self.runner.attention_backend_name,
            max_model_len=max_model_len,
            kv_capacity_tokens=capacity,
            block_size=config.block_size,
            num_kv_pages=self.runner.num_kv_pages,
            vocab_size=mc.vocab_size,
            eos_token_ids=mc.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            prefix_caching=self.scheduler.config.enable_prefix_caching,
            sampling_defaults=sampling_defaults,
        )
        self.structured.compiler.wait()  # ready means no first constrained request stalls the steps

    def _drafter(self, spec: SpeculativeConfig | None) -> Drafter | None:
        if spec is None:
            return None
        if spec.method == "mtp":
            assert self.runner.drafter is not None, "the runner was built without its MTP drafter"
            return self.runner.drafter.propose
        return NgramProposer(spec.ngram_min, spec.ngram_max).propose

    @staticmethod
    def _speculative_config(config: EngineConfig, mc: ModelConfig) -> SpeculativeConfig | None:
        if config.speculative_method is None:
            return None
        spec = SpeculativeConfig(
            method=config.speculative_method,
            num_speculative_tokens=config.num_speculative_tokens,
            ngram_min=config.ngram_min,
            ngram_max=config.ngram_max,
            max_batch=config.speculative_max_batch or DEFAULT_MAX_BATCH,
        )
        hybrid = mc.hybrid is not None
        if spec.method == "mtp" and (not hybrid or mc.moe is not None):
            what = "a Qwen3.5-MoE checkpoint (its MTP head's experts are not loaded yet)" if hybrid else mc.architecture
            raise ConfigError(
                f"--speculative-method mtp: needs a dense Qwen3.5/3.6 checkpoint with mtp.* weights, "
                f"not {what}; use --speculative-method ngram"
            )
        if hybrid:
            logger.info(
                "speculative decoding on a hybrid model: a rejected draft rolls the Gated DeltaNet state "
                "back by recompute (engine/spec_decode/rollback.py)"
            )
        if spec.method == "mtp":
            logger.info(
                "speculative decoding: mtp (the checkpoint's MTP head drafts greedily after each forward), "
                "up to %d draft tokens per step, while at most %d sequences run",
                spec.num_speculative_tokens,
                spec.max_batch,
            )
        else:
            logger.info(
                "speculative decoding: %s, up to %d draft tokens per step, n-gram %d..%d, while at most "
                "%d sequences run",
                spec.method,
                spec.num_speculative_tokens,
                spec.ngram_min,
                spec.ngram_max,
                spec.max_batch,
            )
        return spec

    def _async_scheduling(self, config: EngineConfig, mc: ModelConfig) -> bool:
        """Async scheduling where asked (default: with CUDA), except where every step needs the
        last token on the host: speculative decoding and hybrid models' states."""
        wanted = config.async_scheduling if config.async_scheduling is not None else self.runner.device.type == "cuda"
        if not wanted:
            return False
        if self.speculative is not None or mc.hybrid is not None:
            logger.info(
                "async scheduling off: %s needs each step's tokens before the next is scheduled",
                "speculative decoding" if self.speculative is not None else "a hybrid model's state",
            )
            return False
        logger.info(
            "async scheduling: each step is scheduled while the one before runs; sampled ids are read "
            "back one step late"
        )
        return True

    @staticmethod
    def _kv_events(config: EngineConfig) -> KVEvents | None:
        if config.kv_events_config is None or not config.kv_events_config.enabled:
            return None
        from engine.cache_events.kv_events import KVEvents  # zmq, msgspec and cbor2 only with events on

        return KVEvents(config.kv_events_config, config.block_size, config.data_parallel_rank)

    def close(self) -> None:
        """Send the KV events still queued and close their sockets (the model needs nothing)."""
        if self.kv_events is not None:
            self.kv_events.shutdown()

    @property
    def model_path(self) -> Path:
        return Path(self.info.model_path)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """A validated sample (engine/front/input_processor.py); a constrained one waits in the queue
        with status WAITING_FOR_GRAMMAR until its grammar compiled."""
        params = request.params
        assert params.n == 1, f"{request.request_id}: the front fans n out"
        grammar_ready = None
        if params.structured is not None:
            compiled = self.structured.prepare(params.structured, request.owner.key, request.request_id)
            grammar_ready = compiled.done
        self.scheduler.add_request(
            Request(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.eos_token_ids,
                arrival_time=request.arrival_time,
                grammar_ready=grammar_ready,
                key=request.owner.key,
                weight=request.owner.weight,
                key_priority=request.owner.key_priority,
                priority=request.owner.priority,
            )
        )

    def abort_requests(self, request_ids: list[str] | tuple[str, ...]) -> None:
        """End the requests now, their pages free on return; unknown or finished ids are ignored."""
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            self.structured.remove_request(request_id)  # a grammar nobody waits for is not compiled

    def fail_all(self) -> list[str]:
        """After a failed step: end every live request and forget cached KV (the batch's KV state
        is suspect). Returns the ids it ended."""
        ids = list(self.scheduler.requests)
        for request_id in ids:  # no state checkpoint of a suspect state
            self.scheduler.abort_request(request_id, keep_state=False)
        self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()  # the failed step's BlockStored events, then AllBlocksCleared
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- a step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """With async scheduling, the step's tokens count as computed at once and its sampled
        tokens are placeholders until `update` (so `can_schedule_ahead` may allow the next)."""
        return self.scheduler.schedule(async_step=self.async_scheduling)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is updated."""
        return self.async_scheduling and self.scheduler.can_schedule_ahead()

    def execute(self, out: SchedulerOutput) -> StepResult:
        """The forward and sampling, read back."""
        return self.runner.execute(out)

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """The forward and sampling, the read-back deferred to `PendingStep.result`."""
        return self.runner.launch(out)

    def update(self, out: SchedulerOutput, result: StepResult) -> EngineCoreOutputs:
        """Advance the scheduler by the sampled tokens; what each request got this step."""
        scored = self._unsent_prompt_logprobs(result)
        if self.scheduler.host is not None and self.runner.host_pool is not None:
            load_s, spill_s = self.runner.host_pool.take_seconds()
            self.scheduler.host.load_seconds += load_s
            self.scheduler.host.spill_seconds += spill_s
        emitted: dict[str, tuple[SampledToken, ...]] = {
            rid: result.emitted.get(rid) or (tok,) for rid, tok in result.sampled.items()
        }
        live = self.scheduler.requests
        before = {rid: live[rid].num_output_tokens for rid in emitted if rid in live}
        touched = self.scheduler.update(
            out, {rid: [t.token_id for t in toks] for rid, toks in emitted.items()}, result.rolled_back
        )
        grammar_failed = self.structured.take_failed()  # they end with an error, not as if the model stopped
        for request_id in grammar_failed:
            self.scheduler.abort_request(request_id)
            self.structured.remove_request(request_id)
        outputs = []
        for request in touched:
            if request.request_id in grammar_failed:
                continue
            # The tokens the scheduler kept: a stop inside the accepted drafts ends the list there.
            toks = emitted[request.request_id][: request.num_output_tokens - before[request.request_id]]
            reason = request.finish_reason if request.is_finished else None
            if reason is not None and request.params.structured is not None:
                # Its grammar goes now, not at the runner's next step (which may be long in coming).
                self.structured.remove_request(request.request_id)
            with_logprobs = request.params.logprobs is not None
            single = toks[0] if with_logprobs and len(toks) == 1 else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=tuple(t.token_id for t in toks),
                    finish_reason=None if reason is None else reason.value,
                    stop_reason=request.stop_reason if isinstance(request.stop_reason, int) else None,
                    num_cached_tokens=request.num_cached_tokens,
                    logprob=single.logprob if single else None,
                    top_ids=single.top_ids if single else (),
                    top_logprobs=single.top_logprobs if single else (),
                    token_logprobs=toks if with_logprobs and len(toks) > 1 else (),
                    prompt_logprobs=scored.pop(request.request_id, None),
                )
            )
        # Prefill chunks that sampled nothing: their prompt logprobs go now, with no token. A
        # speculating step is a decode (drafts follow the last sampled token), so it carries none.
        outputs.extend(EngineCoreOutput(rid, (), prompt_logprobs=chunk) for rid, chunk in scored.items())
        drafted, accepted = self._acceptance(out, emitted)
        if self.kv_events is not None:
            self.kv_events.flush()  # what this step's schedule() stored in and evicted from the cache
        return EngineCoreOutputs(
            outputs=tuple(outputs),
            stats=self.scheduler.stats(),
            grammar_cache=self.structured.stats(),
            num_batched_requests=len(out.requests),
            num_batched_tokens=out.num_batched_tokens,
            num_drafts_by_position=drafted,
            num_accepted_by_position=accepted,
            prefix_cache=self.prefix_feed.take() if self.prefix_feed is not None else None,
            failed_request_ids=tuple(grammar_failed),
            error=f"its grammar could not be made ({', '.join(sorted(set(grammar_failed.values())))}); see the "
            "server log"
            if grammar_failed
            else None,
        )

    def _unsent_prompt_logprobs(self, result: StepResult) -> dict[str, PromptLogprobsChunk]:
        """The step's prompt logprobs of live requests that have sampled nothing yet. A request
        preempted after its first token recomputes its prompt, but the front already has those."""
        unsent = {}
        for request_id, chunk in result.prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING and not request.output_token_ids:
                unsent[request_id] = chunk
        return unsent

    @staticmethod
    def _acceptance(
        out: SchedulerOutput, emitted: dict[str, tuple[SampledToken, ...]]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Draft tokens proposed and accepted this step, by draft position."""
        k = max((r.num_draft_tokens for r in out.requests), default=0)
        if k == 0:
            return (), ()
        drafted, accepted = [0] * k, [0] * k
        for r in out.requests:
            num_accepted = len(emitted.get(r.request_id, ())) - 1
            for pos in range(r.num_draft_tokens):
                drafted[pos] += 1
                accepted[pos] += pos < num_accepted
        return tuple(drafted), tuple(accepted)

    def step(self) -> EngineCoreOutputs:
        """schedule + execute + update, synchronously."""
        t0 = time.perf_counter()
        out = self.schedule()
        if out.is_empty:
            return EngineCoreOutputs(stats=self.scheduler.stats(), grammar_cache=self.structured.stats())
        result = self.update(out, self.execute(out))
        return replace(result, step_time_s=time.perf_counter() - t0)
