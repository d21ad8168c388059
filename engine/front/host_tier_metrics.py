"""Metrics of the host KV tier (`--kv-offloading-size`, scheduler/host_tier.py), fed from each engine
core's `SchedulerStats.host`: vLLM's names where vLLM has them (its offloading connector's
`vllm:kv_offload_total_bytes` / `vllm:kv_offload_total_time` by `transfer_type` GPU_to_CPU /
CPU_to_GPU, and `vllm:external_prefix_cache_queries` / `_hits`, the tokens looked up in and served
from the tier), labelled `model_name` and `engine` as the other vLLM series; and our own
`fp4serve_host_kv_*` series, summed over the cores: bytes, pages, snapshots, loads, spills."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from scheduler.output import HostTierStats

GPU_TO_CPU, CPU_TO_GPU = "GPU_to_CPU", "CPU_to_GPU"  # vLLM's transfer_type values, whatever the device
_NONE = HostTierStats(0, 0, 0, 0, 0, 0)


class HostTierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int = 1) -> None:
        r = registry
        labels = ["model_name", "engine"]
        self._engines = [str(i) for i in range(num_engines)]
        self.model_name = model_name
        self.offload_bytes = Counter(
            "vllm:kv_offload_total_bytes",
            "Number of bytes offloaded by KV connector",
            [*labels, "transfer_type"],
            registry=r,
        )
        self.offload_time = Counter(
            "vllm:kv_offload_total_time",
            "Total time measured by all KV offloading operations",
            [*labels, "transfer_type"],
            registry=r,
        )
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from "
            "KV connector cross-instance cache sharing, in terms of number of queried "
            "tokens.",
            labels,
            registry=r,
        )
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV "
            "connector cross-instance cache sharing, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.capacity_bytes = Gauge(
            "fp4serve_host_kv_capacity_bytes",
            "Host memory of the host KV tier (--kv-offloading-size): page and snapshot slots.",
            registry=r,
        )
        self.used_bytes = Gauge(
            "fp4serve_host_kv_used_bytes", "Bytes of the host KV tier holding pages and snapshots.", registry=r
        )
        self.pages = Gauge("fp4serve_host_kv_pages", "KV pages held in the host tier.", registry=r)
        self.snapshots = Gauge(
            "fp4serve_host_kv_snapshots", "Hybrid models' state snapshots held in the host tier.", registry=r
        )
        self.hits = Counter("fp4serve_host_kv_hits", "Prompt tokens served from the host tier.", registry=r)
        # Unlabelled, one per kind, so /stats (api/ops/stats.py) reads each as it reads our other totals.
        self.page_loads = Counter(
            "fp4serve_host_kv_page_loads", "KV pages copied from the host tier back to the device.", registry=r
        )
        self.snapshot_loads = Counter(
            "fp4serve_host_kv_snapshot_loads",
            "State snapshots copied from the host tier into a state slot.",
            registry=r,
        )
        self.page_spills = Counter(
            "fp4serve_host_kv_page_spills", "Evicted KV pages copied into the host tier.", registry=r
        )
        self.snapshot_spills = Counter(
            "fp4serve_host_kv_snapshot_spills", "Dropped state checkpoints copied into the host tier.", registry=r
        )
        self.load_seconds = Counter(
            "fp4serve_host_kv_load_seconds", "Time of the copies back from the host tier.", registry=r
        )
        self._last = [_NONE] * num_engines
        self._now = [_NONE] * num_engines

    def observe(self, stats: HostTierStats | None, engine_index: int = 0) -> None:
        """One core's report: its counters are cumulative (carried over a restart), counters take increments."""
        if stats is None:
            return
        last = self._last[engine_index]
        self._last[engine_index] = stats
        self._now[engine_index] = stats
        engine = (self.model_name, self._engines[engine_index])

        def inc(counter: Counter, now: float, before: float) -> None:
            counter.inc(max(0.0, now - before))

        inc(self.offload_bytes.labels(*engine, GPU_TO_CPU), stats.spilled_bytes, last.spilled_bytes)
        inc(self.offload_bytes.labels(*engine, CPU_TO_GPU), stats.loaded_bytes, last.loaded_bytes)
        inc(self.offload_time.labels(*engine, GPU_TO_CPU), stats.spill_seconds, last.spill_seconds)
        inc(self.offload_time.labels(*engine, CPU_TO_GPU), stats.load_seconds, last.load_seconds)
        inc(self.external_queries.labels(*engine), stats.queried_tokens, last.queried_tokens)
        inc(self.external_hits.labels(*engine), stats.hit_tokens, last.hit_tokens)
        inc(self.hits, stats.hit_tokens, last.hit_tokens)
        inc(self.page_loads, stats.loaded_pages, last.loaded_pages)
        inc(self.snapshot_loads, stats.loaded_snapshots, last.loaded_snapshots)
        inc(self.page_spills, stats.spilled_pages, last.spilled_pages)
        inc(self.snapshot_spills, stats.spilled_snapshots, last.spilled_snapshots)
        inc(self.load_seconds, stats.load_seconds, last.load_seconds)
        every = self._now
        self.capacity_bytes.set(sum(s.capacity_bytes for s in every))
        self.used_bytes.set(sum(s.used_bytes for s in every))
        self.pages.set(sum(s.num_used_pages for s in every))
        self.snapshots.set(sum(s.num_used_snapshots for s in every))
