"""Token ids back to what a client sees: incremental detokenization, stop strings, logprob text
(of sampled tokens, and of prompt tokens gathered over the prefill chunks), the n > 1 fan-in (each
sample's outputs under its parent request), per-request metrics and the
request log line. Runs in the server's process, on the event loop, beside the input processor."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.core_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, PromptLogprobsChunk
from engine.front.detokenizer import Detokenizer
from engine.front.metrics import EngineMetrics
from engine.front.outputs import RequestOutput, TokenLogprob, TopLogprob
from engine.front.tokenizer import Tokenizer

request_logger = logging.getLogger("fp4serve.request")


@dataclass
class _Sample:
    """One sample's output state (the engine core owns its token state)."""

    parent_id: str
    index: int
    num_logprobs: int | None
    detokenizer: Detokenizer
    arrival: float
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] | None  # sent with the first output only
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    key: str = "default"  # the API key's name (usage and per-key metrics)
    prompt: tuple[int, ...] = ()  # the tokens the core's prompt-logprob chunks score
    # With params.prompt_logprobs: one entry per prompt token so far, the first None (nothing scores
    # it); sent with the first output, then None.
    num_prompt_logprobs: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    engine_index: int = 0  # the engine core serving it (data parallel: its vLLM-named series)


class OutputProcessor:
    """Touched on the event loop only."""

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._samples: dict[str, _Sample] = {}  # live samples, in arrival order
        self._children: dict[str, list[str]] = {}  # parent request id -> its live samples

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, children: list[EngineCoreRequest], engine_index: int = 0) -> None:
        assert request_id not in self._children, f"duplicate request id {request_id}"
        for index, child in enumerate(children):
            params = child.params
            self._samples[child.request_id] = _Sample(
                parent_id=request_id,
                index=index,
                num_logprobs=params.logprobs,
                detokenizer=Detokenizer(
                    self.tokenizer.backend, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
                ),
                arrival=child.arrival_time,
                num_prompt_tokens=len(child.prompt_token_ids),
                prompt_token_ids=child.prompt_token_ids,
                key=child.owner.key,
                prompt=child.prompt_token_ids,
                num_prompt_logprobs=params.prompt_logprobs,
                prompt_logprobs=None if params.prompt_logprobs is None else [None],
                engine_index=engine_index,
            )
        self._children[request_id] = [c.request_id for c in children]
        key = children[0].owner.key
        num_prompt = sum(len(c.prompt_token_ids) for c in children)
        self.metrics.prompt_tokens.labels(key=key).inc(num_prompt)
        self.metrics.key_usage(key).prompt_tokens += num_prompt

    def abort(self, request_id: str) -> tuple[list[RequestOutput], list[str]]:
        """End every live sample of the request: their last outputs, and the ids the core must abort."""
        outputs = []
        child_ids = list(self._children.get(request_id, ()))
        for child_id in child_ids:
            sample = self._samples.get(child_id)
            if sample is not None:
                outputs.append(self._finish(child_id, sample, (), "", "abort", None, None))
        return outputs, child_ids

    def fail(self, child_ids: tuple[str, ...] | list[str], error: str) -> list[RequestOutput]:
        """The core ended these samples after a failure: each gets a last output carrying `error`."""
        outputs = []
        for child_id in child_ids:
            sample = self._samples.get(child_id)
            if sample is not None:
                out = self._finish(child_id, sample, (), "", "abort", None, None)
                outputs.append(RequestOutput(**{**out.__dict__, "error": error}))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        return self.fail(list(self._samples), error)

    # ---- a step's outputs -------------------------------------------------------------------------
    def process(self, step: EngineCoreOutputs, engine_index: int = 0) -> tuple[list[RequestOutput], list[str]]:
        """The client-facing outputs of one message of engine core `engine_index`, and the samples a
        stop string ended (the core must abort them)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for core_out in step.outputs:
            sample = self._samples.get(core_out.request_id)
            if sample is None:  # aborted, or ended by a stop string, while the step ran
                continue
            if core_out.prompt_logprobs is not None:
                self._add_prompt_logprobs(sample, core_out.prompt_logprobs)
            if not core_out.new_token_ids and core_out.finish_reason is None:
                continue  # a prefill chunk that only scored prompt tokens
            out = self._token_output(core_out, sample, now)
            if out.finish_reason is not None and core_out.finish_reason is None:
                to_abort.append(core_out.request_id)
            outputs.append(out)
        if step.failed_request_ids:
            outputs.extend(self.fail(step.failed_request_ids, step.error or "the engine failed"))
        self._observe(step, engine_index)
        return outputs, to_abort

    def _observe(self, step: EngineCoreOutputs, engine_index: int) -> None:
        m = self.metrics
        # Generation tokens are counted per sample, with its key, in _token_output (several per
        # step when drafts are accepted).
        if step.num_drafts_by_position:
            m.observe_spec_decode(step.num_drafts_by_position, step.num_accepted_by_position)
        if step.num_batched_requests:
            m.batch_size.observe(step.num_batched_requests)
            m.batch_tokens.observe(step.num_batched_tokens)
            m.vllm[engine_index].iteration_tokens.observe(step.num_batched_tokens)
        if step.step_time_s is not None:
            m.step_time.observe(step.step_time_s)
        if step.stats is not None:
            m.observe_scheduler(step.stats, engine_index)
        if step.grammar_cache is not None:
            m.observe_grammar_cache(step.grammar_cache, engine_index)

    def _token_output(self, core_out: EngineCoreOutput, sample: _Sample, now: float) -> RequestOutput:
        usage = self.metrics.key_usage(sample.key)
        self.metrics.generation_tokens.labels(key=sample.key).inc(len(core_out.new_token_ids))
        usage.completion_tokens += len(core_out.new_token_ids)
        if sample.first_token_time is None:
            sample.first_token_time = now
            self.metrics.ttft.labels(key=sample.key).observe(now - sample.arrival)
            self.metrics.vllm[sample.engine_index].observe_first_token(
                now - sample.arrival, sample.num_prompt_tokens, len(core_out.new_token_ids)
            )
            usage.ttft_seconds_sum += now - sample.arrival
            usage.ttft_count += 1
        else:
            # Per token, not per step: a step that emits several (speculative decoding) spreads
            # its gap over them.
            num_new = max(1, len(core_out.new_token_ids))
            since_last = now - (sample.last_token_time or now)
            gap = since_last / num_new
            for _ in range(num_new):
                self.metrics.itl.observe(gap)
            self.metrics.vllm[sample.engine_index].observe_next_tokens(
                since_last, len(core_out.new_token_ids)
            )  # per step, as vLLM
        sample.last_token_time = now
        sample.num_output_tokens += len(core_out.new_token_ids)
        sample.num_cached_tokens = core_out.num_cached_tokens
        reason: str | None = core_out.finish_reason
        stop_reason: int | str | None = core_out.stop_reason
        # The core stops with "stop" only on a token (EOS or a stop id), which ends the text
        # without showing itself; stop strings are found here. Accepted drafts before that token
        # (speculative decoding) are text.
        feed = list(core_out.new_token_ids[:-1] if reason == "stop" else core_out.new_token_ids)
        text, stop_str = sample.detokenizer.step(feed)
        if stop_str is not None and reason is None:
            reason, stop_reason = "stop", stop_str
        elif reason is not None:
            text += sample.detokenizer.flush()
        logprobs = self._logprobs(core_out, sample.num_logprobs)
        if reason is not None:
            return self._finish(
                core_out.request_id, sample, core_out.new_token_ids, text, reason, stop_reason, logprobs
            )
        out = RequestOutput(
            request_id=sample.parent_id,
            index=sample.index,
            new_token_ids=core_out.new_token_ids,
            text_delta=text,
            finish_reason=None,
            num_prompt_tokens=sample.num_prompt_tokens,
            num_output_tokens=sample.num_output_tokens,
            num_cached_tokens=sample.num_cached_tokens,
            logprobs=logprobs,
            prompt_token_ids=sample.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(sample),
        )
        sample.prompt_token_ids = None
        return out

    def _finish(
        self,
        child_id: str,
        sample: _Sample,
        token_ids: tuple[int, ...],
        text: str,
        reason: str,
        stop_reason: int | str | None,
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> RequestOutput:
        now = time.monotonic()
        e2e = now - sample.arrival
        self.metrics.e2e.observe(e2e)
        self.metrics.requests_finished.labels(finished_reason=reason, key=sample.key).inc()
        usage = self.metrics.key_usage(sample.key)
        usage.requests += 1
        usage.cached_tokens += sample.num_cached_tokens
        ttft = (sample.first_token_time - sample.arrival) if sample.first_token_time else None
        decode_time = now - (sample.first_token_time or now)
        self.metrics.vllm[sample.engine_index].observe_finished(
            reason, e2e, decode_time, sample.num_prompt_tokens, sample.num_output_tokens
        )
        tps = (sample.num_output_tokens - 1) / decode_time if decode_time > 0 and sample.num_output_tokens > 1 else 0.0
        request_logger.info(
            "%s key=%s prompt=%d completion=%d cached=%d ttft=%s tok/s=%.1f e2e=%.3fs finish=%s",
            child_id,
            sample.key,
            sample.num_prompt_tokens,
            sample.num_output_tokens,
            sample.num_cached_tokens,
            f"{ttft:.3f}s" if ttft is not None else "-",
            tps,
            e2e,
            reason,
        )
        out = RequestOutput(
            request_id=sample.parent_id,
            index=sample.index,
            new_token_ids=token_ids,
            text_delta=text,
            finish_reason=reason,
            num_prompt_tokens=sample.num_prompt_tokens,
            num_output_tokens=sample.num_output_tokens,
            num_cached_tokens=sample.num_cached_tokens,
            stop_reason=stop_reason,
            logprobs=logprobs,
            prompt_token_ids=sample.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(sample),
        )
        del self._samples[child_id]
        siblings = self._children.get(sample.parent_id)
        if siblings is not None:
            siblings.remove(child_id)
            if not siblings:
                del self._children[sample.parent_id]
        return out

    def _logprobs(self, core_out: EngineCoreOutput, num_top: int | None) -> tuple[TokenLogprob, ...] | None:
        if num_top is None:
            return None
        if core_out.token_logprobs:  # several tokens this step
            return tuple(
                self._token_logprob(t.token_id, t.logprob, t.top_ids[:num_top], t.top_logprobs[:num_top])
                for t in core_out.token_logprobs
                if t.logprob is not None
            )
        if core_out.logprob is None:
            return None
        token_id = core_out.new_token_ids[-1]
        top_ids, top_logprobs = core_out.top_ids[:num_top], core_out.top_logprobs[:num_top]
        return (self._token_logprob(token_id, core_out.logprob, top_ids, top_logprobs),)

    def _add_prompt_logprobs(self, sample: _Sample, chunk: PromptLogprobsChunk) -> None:
        """Append a prefill chunk's prompt logprobs as text; positions already held (a request
        preempted before its first token recomputes its prompt) are skipped."""
        held = sample.prompt_logprobs
        if held is None:
            return
        assert chunk.start <= len(held), f"prompt logprobs from position {chunk.start}, but only {len(held)} held"
        k = sample.num_prompt_logprobs
        for i in range(len(held) - chunk.start, len(chunk.logprobs)):
            token_id = sample.prompt[chunk.start + i]
            top_ids, top_logprobs = chunk.top_ids[i][:k], chunk.top_logprobs[i][:k]
            held.append(self._token_logprob(token_id, chunk.logprobs[i], top_ids, top_logprobs))

    @staticmethod
    def _take_prompt_logprobs(sample: _Sample) -> tuple[TokenLogprob | None, ...] | None:
        held, sample.prompt_logprobs = sample.prompt_logprobs, None
        return None if held is None else tuple(held)

    def _token_logprob(
        self, token_id: int, logprob: float, top_ids: tuple[int, ...], top_logprobs: tuple[float, ...]
    ) -> TokenLogprob:
        text, raw = self.tokenizer.token_text(token_id)
        top = []
        for tid, lp in zip(top_ids, top_logprobs):
            top_text, top_raw = self.tokenizer.token_text(tid)
            top.append(TopLogprob(tid, top_text, lp, top_raw))
        return TokenLogprob(token_id, text, logprob, raw, tuple(top))
