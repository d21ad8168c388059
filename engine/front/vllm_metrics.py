"""The engine's metrics under vLLM's names, types, help texts, buckets and labels (vLLM's
`PrometheusStatLogger`, vllm/v1/metrics/loggers.py), beside our own `fp4serve_*` series: routers
and dashboards built for vLLM read these (llm-d's inference scheduler: running, waiting and
kv_cache_usage_perc; the production-stack router: the older gpu_cache_usage_perc).

Every series carries `model_name` (the served name) and `engine` (the engine core's index: "0",
or with --data-parallel-size N one series per core, "0" to "N-1", as vLLM labels its data-parallel
engines; `vllm_metrics` makes them). With N > 1, `EngineAggregateRegistry` adds to each `vllm:`
family that has an `engine` label one series without it, for the whole server: the endpoint picker
of the Gateway API Inference Extension reads the engine-less series of one server.
Two names vLLM has since retired are kept for the routers that still read them:
`vllm:gpu_cache_usage_perc` (now kv_cache_usage_perc) and `vllm:time_per_output_token_seconds`
(now inter_token_latency_seconds). Not exposed, for want of the data in this process: the queue
and prefill phase times (the core does not report when a request is first scheduled).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from engine.core_types import EngineInfo
from scheduler.output import SchedulerStats

# vLLM's buckets, as its PrometheusStatLogger sets them.
TTFT_BUCKETS = (
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
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason names, each series made at start
# Ratios of KV pages: their aggregate is the pages used over the pages of all the cores, so each
# core's value weighs by its pages (a mean of the ratios would be wrong when the cores differ in size).
PAGE_RATIOS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})
ENGINE_LABEL = "engine"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class VllmMetrics:
    """One engine core's series, fed by the output processor and the core's stats, in the HTTP
    process. Made by `vllm_metrics`, which registers each name once for every core."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        info: EngineInfo | None = None,
        engine_index: int = 0,
        families: dict[str, Any] | None = None,
    ) -> None:
        """`info`: the engine's, for the token-count buckets (up to max_model_len) and
        vllm:cache_config_info; without it (tests of the page alone) a 4096-token context.
        `families`: the metric families already registered for another core (vllm_metrics)."""
        r = registry
        names = ["model_name", "engine"]
        values = (model_name, str(engine_index))
        first = families is None
        made: dict[str, Any] = {} if families is None else families

        def family(kind: type, name: str, doc: str, **kwargs: Any) -> Any:
            if name not in made:
                made[name] = kind(name, doc, kwargs.pop("labels", names), registry=r, **kwargs)
            return made[name]

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return family(Histogram, name, doc, buckets=buckets).labels(*values)

        self.families = made
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = family(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        token_buckets = build_1_2_5_buckets(info.max_model_len if info is not None else 4096)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        # Info gauges, permanently 1 (vLLM emulates prometheus Info so): the KV cache's shape (vLLM
        # labels it with every CacheConfig field; these are the ones this server has; each core has
        # the same), and LoRA, which it does not serve (llm-d's LoRA-affinity filter reads the empty
        # series; one for the server, as vLLM has).
        if info is not None:
            cache = family(
                Gauge,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=["block_size", "cache_dtype", "num_gpu_blocks", "engine"],
            )
            cache.labels(str(info.block_size), info.dtype, str(info.num_kv_pages), str(engine_index)).set(1)
        self.lora_info: Gauge | None = None
        if first:
            lora = family(
                Gauge,
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            self.lora_info = lora.labels("0", "", "")
            self.lora_info.set_to_current_time()
        self._last = SchedulerStats(0, 0, 0, 1, 0, 0, 0)

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """The gauges, and the cumulative counts the core reports as increments."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_usage)
        self.gpu_cache_usage.set(stats.kv_usage)
        last = self._last
        self.prefix_cache_queries.inc(stats.prefix_cache_queried_tokens - last.prefix_cache_queried_tokens)
        self.prefix_cache_hits.inc(stats.prefix_cache_hit_tokens - last.prefix_cache_hit_tokens)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self._last = stats
        if self.lora_info is not None:
            self.lora_info.set(time.time())  # vLLM stamps it with each scheduler report

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int, num_new_tokens: int) -> None:
        """A sample's first output: its prompt counts as processed then (vLLM counts at prefill end)."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_new_tokens)

    def observe_next_tokens(self, gap_s: float, num_new_tokens: int) -> None:
        """A later output of a sample: the time since its previous one (one observation per step,
        as vLLM records it, whether the step emitted one token or several accepted drafts)."""
        self.itl.observe(gap_s)
        self.tpot.observe(gap_s)
        self.generation_tokens.inc(num_new_tokens)

    def observe_finished(
        self, reason: str, e2e_s: float, decode_s: float, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        self.request_success[reason if reason in self.request_success else "error"].inc()
        self.e2e.observe(e2e_s)
        self.decode_time.observe(decode_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        if num_output_tokens > 1:
            self.request_tpot.observe(decode_s / (num_output_tokens - 1))


def vllm_metrics(
    registry: CollectorRegistry, model_name: str, info: EngineInfo | None = None, num_engines: int = 1
) -> list[VllmMetrics]:
    """The series of each of `num_engines` engine cores, `engine` label "0", "1", ..."""
    first = VllmMetrics(registry, model_name, info)
    return [
        first,
        *(
            VllmMetrics(registry, model_name, info, engine_index=i, families=first.families)
            for i in range(1, num_engines)
        ),
    ]


class EngineAggregateRegistry(CollectorRegistry):
    """A registry that, with several engine cores, serves each `vllm:` family with an `engine` label
    together with its aggregate over the cores: the same series without `engine`. Counters, counts
    and gauges are summed, histogram buckets merged (summed by bound), `_created` the earliest,
    info gauges (`*_info`, always 1) kept at 1, and the KV-page ratios (PAGE_RATIOS) weighed by
    each core's pages (`pages()`: engine label -> KV pages). One family per name, as the exposition
    format needs: the aggregate samples follow the per-core ones in the same family."""

    def __init__(self, num_engines: int, pages: Callable[[], dict[str, int]]) -> None:
        super().__init__()
        self.num_engines = num_engines
        self._pages = pages

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            if (
                self.num_engines > 1
                and family.name.startswith("vllm:")
                and any(ENGINE_LABEL in s.labels for s in family.samples)
            ):
                family.samples = [*family.samples, *self._aggregate(family)]
            yield family

    def _aggregate(self, family: Metric) -> list[Sample]:
        """The engine-less samples of `family`, in the order their series first appear."""
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[Sample]] = {}
        for sample in family.samples:
            if ENGINE_LABEL not in sample.labels:
                continue
            rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != ENGINE_LABEL))
            groups.setdefault((sample.name, rest), []).append(sample)
        pages = self._pages() if family.name in PAGE_RATIOS else {}
        out = []
        for (name, rest), samples in groups.items():
            values = [s.value for s in samples]
            if name.endswith("_created"):
                value = min(values)
            elif family.name.endswith("_info"):
                value = max(values)
            elif pages:
                weights = [pages.get(s.labels[ENGINE_LABEL], 0) for s in samples]
                total = sum(weights)
                value = sum(v * w for v, w in zip(values, weights)) / total if total else 0.0
            else:
                value = sum(values)
            out.append(Sample(name, dict(rest), value))
        return out
