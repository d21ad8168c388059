"""Prometheus metrics of one engine: the aggregate registry (served open by api/ at /metrics), with
our own `fp4serve_*` series and vLLM's names beside them (engine/front/vllm_metrics.py), and the per-key
one (`key_registry`: the same token, request and TTFT series by API key name, served only to an
admin key at /metrics/keys, as /v1/usage shows a user key only its own row). With data parallel the
vLLM names have one series per engine core (label `engine`), and ours are the sums over the cores
(the KV usage: pages used over pages, of all the cores)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.core_types import EngineInfo, GrammarCacheStats
from engine.front.host_tier_metrics import HostTierMetrics
from engine.front.vllm_metrics import EngineAggregateRegistry, VllmMetrics, vllm_metrics
from scheduler.output import SchedulerStats

_NO_GRAMMARS = GrammarCacheStats(0, 0, 0, 0, 0, 0, 0, 0, 0)  # a core before its first constrained request
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class KeyUsage:
    """One API key's totals since start (GET /v1/usage); the key's name, never its secret."""

    requests: int = 0  # finished samples
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0

    def as_dict(self) -> dict[str, float | int]:
        mean = self.ttft_seconds_sum / self.ttft_count if self.ttft_count else None
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "mean_ttft_seconds": mean,
        }


# ---- per-key series -------------------------------------------------------------------------------
class _Both:
    """One labelled child in each registry."""

    def __init__(self, total: Any, by_key: Any) -> None:
        self._total = total
        self._by_key = by_key

    def inc(self, amount: float = 1.0) -> None:
        self._total.inc(amount)
        self._by_key.inc(amount)

    def observe(self, value: float) -> None:
        self._total.observe(value)
        self._by_key.observe(value)


class PerKey:
    """A series kept twice under one name: summed over keys (open) and by `key` (admin only). Callers
    write `.labels(key=..., **other_labels)` as on a labelled prometheus_client metric."""

    def __init__(
        self,
        kind: type[Counter] | type[Histogram],
        name: str,
        documentation: str,
        labels: list[str],
        registry: CollectorRegistry,
        key_registry: CollectorRegistry,
        **kwargs: Any,
    ) -> None:
        self.total = kind(name, documentation, labels, registry=registry, **kwargs)
        self.by_key = kind(name, documentation + " By API key name.", [*labels, "key"], registry=key_registry, **kwargs)
        self._labelled = bool(labels)

    def labels(self, key: str, **labels: str) -> _Both:
        total = self.total.labels(**labels) if self._labelled else self.total
        return _Both(total, self.by_key.labels(key=key, **labels))


class EngineMetrics:
    def __init__(self, model_name: str, info: EngineInfo | None = None, num_engines: int = 1) -> None:
        """`info`: the engine's (the vLLM-named series describe its KV cache); the page's tests pass none.
        `num_engines`: engine cores (--data-parallel-size)."""
        # With several cores, each vLLM series also comes summed over them, without `engine`.
        self.registry: CollectorRegistry = EngineAggregateRegistry(num_engines, self._pages_by_engine)
        self.key_registry = CollectorRegistry()  # NOTE: names API keys and their usage: admin keys only
        r, k = self.registry, self.key_registry
        # The same measurements under vLLM's names, for the routers that read those
        # (engine/front/vllm_metrics.py): one per engine core, indexed by its rank.
        self.vllm: list[VllmMetrics] = vllm_metrics(r, model_name, info, num_engines)
        self.host_tier = HostTierMetrics(r, model_name, num_engines)  # --kv-offloading-size
        self.running = Gauge("fp4serve_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("fp4serve_num_requests_waiting", "Requests waiting (new or preempted).", registry=r)
        self.kv_usage = Gauge(
            "fp4serve_kv_cache_usage_ratio", "KV pages held by live requests / all KV pages.", registry=r
        )
        self.kv_pages_total = Gauge("fp4serve_kv_cache_pages_total", "KV pages in the cache.", registry=r)
        # The token, request and TTFT series are also kept by `key`, the API key's name ("default"
        # without keys), in the admin-only registry.
        self.prompt_tokens = PerKey(Counter, "fp4serve_prompt_tokens", "Prompt tokens of admitted requests.", [], r, k)
        self.generation_tokens = PerKey(Counter, "fp4serve_generation_tokens", "Generated tokens.", [], r, k)
        self.usage: dict[str, KeyUsage] = {}  # key name -> totals (the front process sees every token)
        self.prefix_queries = Counter(
            "fp4serve_prefix_cache_queries", "Tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter("fp4serve_prefix_cache_hits", "Tokens found in the prefix cache.", registry=r)
        self.preemptions = Counter(
            "fp4serve_num_preemptions", "Requests preempted (KV freed, recomputed later).", registry=r
        )
        self.requests_finished = PerKey(
            Counter, "fp4serve_request_success", "Finished requests by finish reason.", ["finished_reason"], r, k
        )
        self.ttft = PerKey(
            Histogram,
            "fp4serve_time_to_first_token_seconds",
            "Arrival to first sampled token.",
            [],
            r,
            k,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "fp4serve_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fp4serve_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "fp4serve_batch_size", "Requests in each engine step's batch.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "fp4serve_step_duration_seconds", "Wall time of one engine step.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "fp4serve_batch_tokens",
            "Tokens in each engine step's batch.",
            buckets=(1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "fp4serve_spec_decode_draft_tokens", "Draft tokens proposed for verification.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "fp4serve_spec_decode_accepted_tokens", "Draft tokens the target model accepted.", registry=r
        )
        self.spec_draft_by_position = Counter(
            "fp4serve_spec_decode_draft_tokens_per_position",
            "Draft tokens proposed, by draft position (0 = first).",
            ["position"],
            registry=r,
        )
        self.spec_accepted_by_position = Counter(
            "fp4serve_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted, by draft position (0 = first).",
            ["position"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "fp4serve_engine_restarts",
            "Engine processes lost and restarted, by why: crash, hang or error (engine/client/supervisor.py).",
            ["reason"],
            registry=r,
        )
        self._grammar_cache_metrics(r, num_engines)
        model_info = Gauge("fp4serve_model_info", "The model being served.", ["model_name"], registry=r)
        model_info.labels(model_name=model_name).set(1)
        pages = max(info.num_kv_pages, 1) if info is not None else 1
        self._stats = [SchedulerStats(0, 0, 0, pages, 0, 0, 0)] * num_engines  # each core's last report

    # ---- the compiled-grammar cache (engine/structured_output/grammar_cache.py), reported by the engine's steps ----
    def _grammar_cache_metrics(self, r: CollectorRegistry, num_engines: int) -> None:
        """The gauges sum the engine cores' caches (each core has its own, of --grammar-cache-bytes)."""
        self.grammar_cache_bytes = Gauge(
            "fp4serve_grammar_cache_bytes", "Compiled grammars kept: xgrammar's size of each, summed.", registry=r
        )
        self.grammar_cache_budget = Gauge(
            "fp4serve_grammar_cache_budget_bytes",
            "The compiled-grammar budget (--grammar-cache-bytes, once per engine core).",
            registry=r,
        )
        self.grammar_cache_entries = Gauge("fp4serve_grammar_cache_entries", "Compiled grammars kept.", registry=r)
        self.grammar_held_bytes = Gauge(
            "fp4serve_grammar_held_bytes",
            "Compiled grammars out of the cache that running or waiting requests "
            "still hold (xgrammar's size); with fp4serve_grammar_cache_bytes, all the engine holds.",
            registry=r,
        )
        self.grammar_compiles_waiting = Gauge(
            "fp4serve_grammar_compiles_waiting", "Grammars compiling or waiting for a compile thread.", registry=r
        )
        self.grammar_cache_hits = Counter(
            "fp4serve_grammar_cache_hits",
            "Constrained requests whose grammar was kept or already compiling.",
            registry=r,
        )
        self.grammar_cache_misses = Counter(
            "fp4serve_grammar_cache_misses", "Constrained requests that started a compile.", registry=r
        )
        self.grammar_cache_evictions = Counter(
            "fp4serve_grammar_cache_evictions",
            "Compiled grammars dropped for the budget (or too large to keep).",
            registry=r,
        )
        self.grammar_failures = Counter(
            "fp4serve_grammar_failures",
            "Constrained requests ended with an error because their grammar could not "
            "be made, by reason: tokenizer (the compiler's tables), build (our EBNF of the spec), compile "
            "(xgrammar refused it).",
            ["reason"],
            registry=r,
        )
        self._grammar = [_NO_GRAMMARS] * num_engines  # each core's last report

    def observe_grammar_cache(self, stats: GrammarCacheStats, engine_index: int = 0) -> None:
        last, self._grammar[engine_index] = self._grammar[engine_index], stats
        self._set_grammar_gauges()
        self.grammar_cache_hits.inc(stats.hits - last.hits)
        self.grammar_cache_misses.inc(stats.misses - last.misses)
        self.grammar_cache_evictions.inc(stats.evictions - last.evictions)
        before = dict(last.failures)
        for reason, count in stats.failures:
            if count > before.get(reason, 0):
                self.grammar_failures.labels(reason=reason).inc(count - before.get(reason, 0))

    def on_core_lost(self, engine_index: int) -> None:
        """Engine core `engine_index` was lost: its grammar cache went with it, and its successor
        counts from zero (its scheduler's counts are carried over, engine/client/supervisor.py)."""
        self._grammar[engine_index] = _NO_GRAMMARS
        self._set_grammar_gauges()

    def _set_grammar_gauges(self) -> None:
        every = self._grammar
        self.grammar_cache_bytes.set(sum(g.num_bytes for g in every))
        self.grammar_cache_budget.set(sum(g.budget_bytes for g in every))
        self.grammar_cache_entries.set(sum(g.num_entries for g in every))
        self.grammar_held_bytes.set(sum(g.held_bytes for g in every))
        self.grammar_compiles_waiting.set(sum(g.num_compiling + g.num_queued for g in every))

    def key_usage(self, key: str) -> KeyUsage:
        return self.usage.setdefault(key, KeyUsage())

    def observe_spec_decode(self, drafted: tuple[int, ...], accepted: tuple[int, ...]) -> None:
        """One step's drafts and acceptances by draft position; acceptance at position i is
        accepted_per_position{position=i} / draft_tokens_per_position{position=i}."""
        self.spec_draft_tokens.inc(sum(drafted))
        self.spec_accepted_tokens.inc(sum(accepted))
        for pos, (d, a) in enumerate(zip(drafted, accepted)):
            self.spec_draft_by_position.labels(position=str(pos)).inc(d)
            self.spec_accepted_by_position.labels(position=str(pos)).inc(a)

    def _pages_by_engine(self) -> dict[str, int]:
        """Each core's KV pages, by its `engine` label, from its last report."""
        return {str(i): stats.num_blocks for i, stats in enumerate(self._stats)}

    def observe_scheduler(self, stats: SchedulerStats, engine_index: int = 0) -> None:
        self.vllm[engine_index].observe_scheduler(stats)
        self.host_tier.observe(stats.host, engine_index)
        last, self._stats[engine_index] = self._stats[engine_index], stats
        # The block manager keeps cumulative counts; counters take the increments.
        self.prefix_queries.inc(stats.prefix_cache_queried_tokens - last.prefix_cache_queried_tokens)
        self.prefix_hits.inc(stats.prefix_cache_hit_tokens - last.prefix_cache_hit_tokens)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        every = self._stats
        self.running.set(sum(s.num_running for s in every))
        self.waiting.set(sum(s.num_waiting for s in every))
        num_blocks = sum(s.num_blocks for s in every)
        self.kv_usage.set(sum(s.num_used_blocks for s in every) / num_blocks)
        self.kv_pages_total.set(num_blocks)
