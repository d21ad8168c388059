"""Request state owned by the scheduler: sampling parameters, token ids, KV pages, status.

`SamplingParams` is frozen and crosses every boundary; `Request` is mutable and lives only
inside the scheduler (mutated on the event-loop thread).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from scheduler.structured_output import StructuredOutput


class ParamError(ValueError):
    """A user mistake in request parameters; api/ turns it into a 400 naming `param` (and `code`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away, or the server ended it


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Defaults follow vLLM's."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: plus top N
    # Logprobs of the prompt's tokens (vLLM's prompt_logprobs), as `logprobs`: None, 0 or top N.
    # Such a request takes no prefix-cache hit, so every prompt position is computed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the output must be (a JSON schema, forced tool calls, ...): engine/structured_output/manager.py
    # compiles it, and the request stops when it is complete.
    structured: StructuredOutput | None = None
    # False: never draft tokens for this request (the per-request opt-out of speculative decoding).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> ParamError:
            return ParamError(f"{param} {why}", param)

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if not math.isfinite(self.temperature) or not (0.0 <= self.temperature <= 2.0):
            raise bad("temperature", f"must be in [0, 2], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (off) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for _, bias in self.logit_bias:
            if not (-100.0 <= bias <= 100.0):
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("top_logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of the index-th of `n` samples: one sample each, seed + index (as vLLM)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued, its grammar still compiling (vLLM's WAITING_FOR_FSM)
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; resumes by recompute
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated. Mutable; owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens sampled by steps still in flight, not yet read back. Such a request
    # was scheduled as if they were known (the runner takes them from the device), so its
    # num_computed_tokens already counts them (scheduler/scheduler.py `schedule(async_step=True)`).
    num_output_placeholders: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained prefix-cache hashes of this request's full pages, in order (grows lazily).
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading pages of block_table already offered to the prefix cache (block_manager's cursor).
    num_registered_blocks: int = 0
    state_slot: int | None = None  # hybrid models: the recurrent-state slot held while running
    # Hybrid prefix caching: where this request's cached pages end beyond the checkpoint it restored
    # (a prefix shared with an earlier request); a snapshot is taken there. 0: none.
    checkpoint_junction: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    # Speculative decoding with an adaptive length: the drafts to ask for next step (0: the most).
    draft_len: int = 0
    # For a constrained request: whether its grammar has compiled. Until then the request waits
    # in the queue with status WAITING_FOR_GRAMMAR and the scheduler passes over it.
    grammar_ready: Callable[[], bool] | None = field(default=None, repr=False)
    # Who asked (scheduler/fair_queue.py): the API key's name and fair-share weight, the key's
    # priority and the request's own vLLM `priority` (lower first).
    key: str = "default"
    weight: float = 1.0
    key_priority: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        if self.grammar_ready is not None and self.status is RequestStatus.WAITING:
            self.status = RequestStatus.WAITING_FOR_GRAMMAR

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def at_length_limit(self) -> bool:
        """Its placeholders already reach max_tokens or the context: no step is left to schedule."""
        n = self.num_tokens_with_placeholders
        max_tokens = self.params.max_tokens
        return n >= self.max_model_len or (max_tokens is not None and n - self.num_prompt_tokens >= max_tokens)

    def token_id(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, token_id: int) -> bool:
        """After appending `token_id`: set the finish reason if a token-level stop is hit."""
        num_out = len(self.output_token_ids)
        if num_out >= self.params.min_tokens:
            if not self.params.ignore_eos and token_id in self.eos_token_ids:
                self.finish_reason = FinishReason.STOP
                return True
            if token_id in self.params.stop_token_ids:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = token_id
                return True
        if self.params.max_tokens is not None and num_out >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        if self.num_tokens >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
