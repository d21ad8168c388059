"""What crosses the engine-core boundary, both ways: token ids and plain values only, so the
core can live in another process (engine/core_proc.py) and know no text.

front -> core: `AddRequests` (a request's samples: the input processor fans n out), aborts, shutdown;
with data parallel, `FairShareUpdate` (what the other cores served each key).
core -> front: `EngineCoreOutputs` once per step (each request's new tokens and finish reason, the
scheduler's gauges; with data parallel, what entered and left the prefix cache), or a failure /
death notice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.fair_queue import FairShareState
from scheduler.output import SchedulerOutput, SchedulerStats
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler

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
    vocab_size: int = 0  # the model's logits width: every user token id is checked against it
    eos_token_ids: tuple[int, ...] = ()  # from config.json and generation_config.json
    max_num_seqs: int = 128
    prefix_caching: bool = True  # whether the scheduler reuses cached pages (data parallel places by them)
    # (field, value) sampling defaults from generation_config.json (engine/weights/config/generation_config.py),
    # for the fields a request leaves out
    sampling_defaults: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Owner:
    """Who a request is for, as the scheduler's fair share sees it: the API key's name (never the
    secret), its weight and priority, and the request's own vLLM `priority` (lower first). The HTTP
    handler builds it from the key's record and the body, and passes it to AsyncEngine.generate."""

    key: str = "default"
    weight: float = 1.0
    key_priority: int = 0
    priority: int = 0


@dataclass(frozen=True)
class EngineCoreRequest:
    """One sample to generate, already validated (engine/front/input_processor.py)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # n == 1
    eos_token_ids: tuple[int, ...]
    arrival_time: float  # time.monotonic() in the front's process
    owner: Owner = Owner()  # who asked, for fair share (scheduler/fair_queue.py) and per-key usage


@dataclass(frozen=True)
class SampledToken:
    """One sampled token of one request in a step, as the runner returns it."""

    token_id: int
    logprob: float | None = None  # log-softmax of the raw logits at the sampled id
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """The logprobs of some of a prompt's tokens, from one prefill chunk (`SamplingParams.prompt_logprobs`):
    entry i scores the prompt token at position `start + i` (start >= 1: nothing scores the first)."""

    start: int
    logprobs: tuple[float, ...]  # of the prompt's own token at each position
    top_ids: tuple[tuple[int, ...], ...]  # per position, the top `prompt_logprobs` ids, best first
    top_logprobs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        assert self.start >= 1, f"prompt logprobs start at position {self.start}"
        assert len(self.logprobs) == len(self.top_ids) == len(self.top_logprobs), "one entry per position"


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request: ids and numbers, no text. A prefill chunk that
    sampled nothing but scored prompt tokens sends one with no `new_token_ids`."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    logprob: float | None = None  # of the sampled token, when the request asked for logprobs
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    prompt_logprobs: PromptLogprobsChunk | None = None  # this step's prefill rows, when asked for
    # Several tokens in one step (speculative decoding), when logprobs were asked for: one entry
    # per new token; the three fields above then stay unset.
    token_logprobs: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class PrefixCacheDelta:
    """What one step changed in a core's prefix cache, as page hashes (the scheduler's own chain,
    scheduler/block_manager.py `hash_block`): with data parallel, the front keeps a copy of each
    core's set to place requests where their prefix is (engine/client/placement.py). Apply `cleared`,
    then `removed`, then `stored`."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False  # every hash was forgotten (a failed step), before the two above


@dataclass(frozen=True)
class GrammarCacheStats:
    """The compiled-grammar cache of engine/structured_output/grammar_cache.py, as one step leaves it."""

    num_bytes: int  # kept, charged to the budget: xgrammar's size of each
    budget_bytes: int  # --grammar-cache-bytes
    num_entries: int  # grammars kept
    held_bytes: int  # grammars out of the cache (evicted, or larger than the budget) that requests still hold
    num_compiling: int
    num_queued: int  # waiting for a compile worker (each key compiles one at a time)
    hits: int  # cumulative: requests whose grammar was kept or already compiling
    misses: int  # cumulative: requests that started a compile
    evictions: int  # cumulative: kept grammars dropped for the budget, or too large to keep
    # cumulative, by reason: requests whose grammar could not be made (engine/structured_output/compiler.py)
    failures: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class EngineCoreOutputs:
    """One message from the core: a step's outputs, or a failure that ended requests."""

    outputs: tuple[EngineCoreOutput, ...] = ()
    stats: SchedulerStats | None = None
    num_batched_requests: int = 0
    num_batched_tokens: int = 0
    step_time_s: float | None = None  # None: not a step (an idle report, a failure)
    # Speculative decoding this step: drafts proposed / accepted at draft position 0, 1, ...
    num_drafts_by_position: tuple[int, ...] = ()
    num_accepted_by_position: tuple[int, ...] = ()
    failed_request_ids: tuple[str, ...] = ()  # ended by a failed step, with `error`
    error: str | None = None
    dead: str | None = None  # the core stopped for this reason: nothing more will come
    # With `dead`: the supervisor is starting a new core in its place, after a "crash", a "hang" or
    # an "error" (engine/client/supervisor.py); None: no core will follow.
    restart: str | None = None
    prefix_cache: PrefixCacheDelta | None = None  # data parallel only (engine/cache_events/prefix_cache_feed.py)
    grammar_cache: GrammarCacheStats | None = None  # None until the first constrained request


@dataclass(frozen=True)
class AddRequests:
    """A request's samples, added in one step: the n samples of one request start together."""

    requests: tuple[EngineCoreRequest, ...]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class FairShareUpdate:
    """Data parallel: each listed key's fair-share charges on the other engine cores, in all
    (engine/client/global_fair_share.py); the core orders its waiting requests by its own plus these."""

    external: FairShareState


@dataclass(frozen=True)
class Shutdown:
    pass


class EngineCoreProtocol(Protocol):
    """What the core loop (engine/core_proc.py) and AsyncEngine's in-process client need of an
    engine core: engine/core.py's `EngineCore`, or a test's proxy of one."""

    info: EngineInfo
    scheduler: Scheduler  # its stats() are reported while idle

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: Sequence[str]) -> None: ...
    def fail_all(self) -> list[str]: ...
    def has_unfinished(self) -> bool: ...
    def schedule(self) -> SchedulerOutput: ...
    # The step's forward result, handed back to update() unread (engine/model_runner.py StepResult).
    def execute(self, out: SchedulerOutput) -> Any: ...
    def update(self, out: SchedulerOutput, result: Any) -> EngineCoreOutputs: ...
