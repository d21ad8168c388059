"""The engine core: scheduler + model runner + output processing (detokenization, stop
strings, logprobs, metrics). Three calls make a step — `schedule()`, `execute()`, `process()` —
so the async front can run `execute` in a worker thread and the rest on the event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import Detokenizer
from engine.metrics import EngineMetrics
from engine.model_runner import ModelRunner, StepResult
from engine.outputs import RequestOutput, SampledToken, TokenLogprob, TopLogprob
from engine.structured import StructuredOutputs
from engine.tokenizer import Tokenizer
from scheduler.output import SchedulerOutput
from scheduler.request import FinishReason, ParamError, Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("fp4serve.engine")
request_logger = logging.getLogger("fp4serve.request")

VERSION = "0.1.0"


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    model_path: str
    is_demo: bool
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    num_kv_pages: int
    version: str = VERSION


@dataclass
class _Sample:
    """Per-sample output state (the scheduler owns the token state)."""

    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: Detokenizer
    arrival: float
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] | None  # sent with the first output only
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    finished: bool = False
    # With params.prompt_logprobs: one per prompt token so far (the first None), sent with the
    # first output; None otherwise, and once sent
    prompt_logprobs: list[TokenLogprob | None] | None = None


def resolve_model_path(config: EngineConfig) -> tuple[Path, bool]:
    """The HF folder to load (a GGUF converted once into the cache) and whether it is the demo."""
    from engine.model_source import resolve_model

    source = resolve_model(config.model)
    return source.path, source.is_demo


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path, is_demo = resolve_model_path(config)
        self.model_config = ModelConfig.from_checkpoint(path)
        mc = self.model_config
        max_model_len = config.max_model_len or mc.max_position_embeddings
        self.tokenizer = Tokenizer(path, mc.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer.hf, mc.vocab_size)
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
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        from engine.model_source import model_name

        self.info = EngineInfo(
            model_name=config.served_model_name or model_name(config.model),
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
        )
        self.metrics = EngineMetrics(self.info.model_name)
        self._samples: dict[str, _Sample] = {}
        # Constrained requests held out of the scheduler while their grammar compiles.
        self._compiling: list[Request] = []
        self._children: dict[str, list[str]] = {}

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, param_name: str = "prompt") -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("the prompt is empty", param_name)
        if n >= self.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} tokens "
                f"(it must leave room for at least one generated token)",
                param_name,
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        if params.grammar is not None:
            StructuredOutputs.check(params.grammar)
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(f"token id {bad} is out of range for a vocabulary of {vocab}", param_name)
        for token_id, _ in params.logit_bias:
            if not 0 <= token_id < vocab:
                raise ParamError(f"logit_bias token id {token_id} is out of range for a vocabulary of {vocab}", "logit_bias")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        assert request_id not in self._children, f"duplicate request id {request_id}"
        self.validate(prompt_token_ids, params)
        now = time.monotonic()
        children = []
        for i in range(params.n):
            child_id = f"{request_id}#{i}"
            child_params = params.for_sample(i) if params.n > 1 else params
            self._samples[child_id] = _Sample(
                parent_id=request_id,
                index=i,
                params=child_params,
                detokenizer=Detokenizer(
                    self.tokenizer.backend, child_params.stop, child_params.skip_special_tokens,
                    child_params.include_stop_str_in_output,
                ),
                arrival=now,
                num_prompt_tokens=len(prompt_token_ids),
                prompt_token_ids=tuple(prompt_token_ids),
                prompt_logprobs=None if params.prompt_logprobs is None else [None],
            )
            request = Request(child_id, list(prompt_token_ids), child_params, self.tokenizer.eos_token_ids, arrival_time=now)
            if child_params.grammar is not None and not self.structured.prepare(child_params.grammar).done():
                self._compiling.append(request)  # joins the scheduler once its grammar compiled
            else:
                self.scheduler.add_request(request)
            children.append(child_id)
        self._children[request_id] = children
        self.metrics.prompt_tokens.inc(len(prompt_token_ids) * params.n)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End every live sample of the request now; their pages are free on return."""
        outputs = []
        for child_id in self._children.get(request_id, []):
            sample = self._samples.get(child_id)
            if sample is None or sample.finished:
                continue
            req = self.scheduler.abort_request(child_id)
            self._compiling = [r for r in self._compiling if r.request_id != child_id]
            num_cached = req.num_cached_tokens if req else 0
            outputs.append(self._finish_output(child_id, sample, (), "", FinishReason.ABORT, None, None, num_cached))
        self._forget(request_id)
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an engine failure: end every live request with an error, forget cached KV."""
        outputs = []
        for request_id in list(self._children):
            for out in self.abort_request(request_id):
                outputs.append(RequestOutput(**{**out.__dict__, "error": message}))
        self.scheduler.block_manager.reset_prefix_cache()
        return outputs

    def waiting_requests(self) -> list[Request]:
        """Requests not yet running, oldest first: the scheduler's waiting queue, then those
        held while their grammar compiles."""
        return [*self.scheduler.waiting, *self._compiling]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def _forget(self, request_id: str) -> None:
        for child_id in self._children.pop(request_id, []):
            self._samples.pop(child_id, None)

    # ---- a step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._compiling:  # constrained requests whose grammar is now ready join, oldest first
            ready = [r for r in self._compiling if self.structured.prepare(r.params.grammar or "").done()]
            for request in ready:
                self.scheduler.add_request(request)
            self._compiling = [r for r in self._compiling if r not in ready]
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput) -> StepResult:
        """The forward and sampling: the only call that may run off the event loop."""
        return self.runner.execute(out)

    def process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        for request_id, (first, tokens) in result.prompt_logprobs.items():
            self._add_prompt_logprobs(request_id, first, tokens)
        sampled = {rid: tok.token_id for rid, tok in result.sampled.items()}
        touched = self.scheduler.update(out, sampled)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for request in touched:
            sample = self._samples.get(request.request_id)
            if sample is None:
                continue
            tok = result.sampled[request.request_id]
            outputs.append(self._token_output(request, sample, tok, now))
        self.metrics.generation_tokens.inc(len(touched))
        if out.requests:
            self.metrics.batch_size.observe(len(out.requests))
            self.metrics.batch_tokens.observe(out.num_batched_tokens)
        self.metrics.observe_scheduler(self.scheduler.stats())
        return outputs

    def step(self) -> list[RequestOutput]:
        """schedule + execute + process, synchronously (the offline front)."""
        out = self.schedule()
        return self.process(out, self.execute(out))

    def _token_output(self, request: Request, sample: _Sample, tok: SampledToken, now: float) -> RequestOutput:
        if sample.first_token_time is None:
            sample.first_token_time = now
            self.metrics.ttft.observe(now - sample.arrival)
        else:
            self.metrics.itl.observe(now - (sample.last_token_time or now))
        sample.last_token_time = now
        sample.num_output_tokens += 1
        reason = request.finish_reason
        # The scheduler stops with STOP only on a token (EOS or a stop id), which ends the text
        # without showing itself; stop strings are found below.
        feed = [] if reason is FinishReason.STOP else [tok.token_id]
        text, stop_str = sample.detokenizer.step(feed)
        stop_reason = request.stop_reason
        if stop_str is not None and not request.is_finished:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP, stop_str)
            reason, stop_reason = FinishReason.STOP, stop_str
        elif request.is_finished:
            text += sample.detokenizer.flush()
        logprobs = self._logprobs(tok, sample.params.logprobs)
        if reason is not None:
            return self._finish_output(request.request_id, sample, (tok.token_id,), text, reason, stop_reason, logprobs, request.num_cached_tokens)
        out = RequestOutput(
            request_id=sample.parent_id,
            index=sample.index,
            new_token_ids=(tok.token_id,),
            text_delta=text,
            finish_reason=None,
            num_prompt_tokens=sample.num_prompt_tokens,
            num_output_tokens=sample.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=logprobs,
            prompt_token_ids=sample.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(sample),
        )
        sample.prompt_token_ids = None
        return out

    def _finish_output(
        self,
        child_id: str,
        sample: _Sample,
        token_ids: tuple[int, ...],
        text: str,
        reason: FinishReason,
        stop_reason: int | str | None,
        logprobs: tuple[TokenLogprob, ...] | None,
        num_cached: int,
    ) -> RequestOutput:
        sample.finished = True
        now = time.monotonic()
        e2e = now - sample.arrival
        self.metrics.e2e.observe(e2e)
        self.metrics.requests_finished.labels(finished_reason=reason.value).inc()
        ttft = (sample.first_token_time - sample.arrival) if sample.first_token_time else None
        decode_time = now - (sample.first_token_time or now)
        tps = (sample.num_output_tokens - 1) / decode_time if decode_time > 0 and sample.num_output_tokens > 1 else 0.0
        request_logger.info(
            "%s prompt=%d completion=%d cached=%d ttft=%s tok/s=%.1f e2e=%.3fs finish=%s",
            child_id, sample.num_prompt_tokens, sample.num_output_tokens, num_cached,
            f"{ttft:.3f}s" if ttft is not None else "-", tps, e2e, reason.value,
        )
        out = RequestOutput(
            request_id=sample.parent_id,
            index=sample.index,
            new_token_ids=token_ids,
            text_delta=text,
            finish_reason=reason.value,
            num_prompt_tokens=sample.num_prompt_tokens,
            num_output_tokens=sample.num_output_tokens,
            num_cached_tokens=num_cached,
            stop_reason=stop_reason,
            logprobs=logprobs,
            prompt_token_ids=sample.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(sample),
        )
        sample.prompt_token_ids = None
        siblings = self._children.get(sample.parent_id, [])
        if all(self._samples[c].finished for c in siblings if c in self._samples):
            self._forget(sample.parent_id)
        return out

    def _add_prompt_logprobs(self, child_id: str, first: int, tokens: tuple[SampledToken, ...]) -> None:
        """Append a prefill chunk's prompt logprobs; positions already held (a preempted request
        recomputes its prompt) are skipped."""
        sample = self._samples.get(child_id)
        if sample is None or sample.prompt_logprobs is None:
            return
        held = len(sample.prompt_logprobs)
        assert first <= held, f"{child_id}: prompt logprobs from position {first}, but only {held} held"
        for tok in tokens[held - first:]:
            [entry] = self._logprobs(tok, sample.params.prompt_logprobs) or (None,)
            sample.prompt_logprobs.append(entry)

    @staticmethod
    def _take_prompt_logprobs(sample: _Sample) -> tuple[TokenLogprob | None, ...] | None:
        held, sample.prompt_logprobs = sample.prompt_logprobs, None
        return None if held is None else tuple(held)

    def _logprobs(self, tok: SampledToken, num_top: int | None) -> tuple[TokenLogprob, ...] | None:
        if num_top is None or tok.logprob is None:
            return None
        text, raw = self.tokenizer.token_text(tok.token_id)
        top = []
        for tid, lp in zip(tok.top_ids[:num_top], tok.top_logprobs[:num_top]):
            top_text, top_raw = self.tokenizer.token_text(tid)
            top.append(TopLogprob(tid, top_text, lp, top_raw))
        return (TokenLogprob(tok.token_id, text, tok.logprob, raw, tuple(top)),)
