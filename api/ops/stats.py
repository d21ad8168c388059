"""`GET /stats`: a small JSON summary of the Prometheus metrics for the built-in dashboard (api/ops/ui.py):
current gauges, cumulative counters, rates and TTFT / ITL / e2e percentiles over a recent window,
and each engine core's queue, KV use and prefix-cache hits (`engines`: one entry, or one per core
with --data-parallel-size, from the vLLM-named series' `engine` label; the rest sums the cores).
`StatsWindow` keeps the few snapshots of the cumulative counts that the rates and windows need."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.http import json_response, server_state

LATENCY_WINDOW_S = 60.0  # percentiles cover about the last minute
RATE_WINDOW_S = 5.0  # tokens/s cover about the last five seconds
MIN_SNAPSHOT_GAP_S = 1.0  # at most one snapshot a second, however many dashboards poll
# Reading the registries takes ~1-2 ms of the event loop; many open dashboards share one reading.
REUSE_S = 0.25
QUANTILES = (0.5, 0.9, 0.99)
_HISTOGRAMS = {
    "ttft_s": "fp4serve_time_to_first_token_seconds",
    "itl_s": "fp4serve_inter_token_latency_seconds",
    "e2e_s": "fp4serve_e2e_request_latency_seconds",
}
_COUNTERS = {
    "prompt_tokens": "fp4serve_prompt_tokens_total",
    "generation_tokens": "fp4serve_generation_tokens_total",
    "prefix_queried_tokens": "fp4serve_prefix_cache_queries_total",
    "prefix_hit_tokens": "fp4serve_prefix_cache_hits_total",
    "preemptions": "fp4serve_num_preemptions_total",
    # The host KV tier (--kv-offloading-size, engine/front/host_tier_metrics.py).
    "host_kv_hit_tokens": "fp4serve_host_kv_hits_total",
    "host_kv_page_loads": "fp4serve_host_kv_page_loads_total",
    "host_kv_page_spills": "fp4serve_host_kv_page_spills_total",
    "host_kv_snapshot_loads": "fp4serve_host_kv_snapshot_loads_total",
    "host_kv_snapshot_spills": "fp4serve_host_kv_snapshot_spills_total",
    "host_kv_load_seconds": "fp4serve_host_kv_load_seconds_total",
}
# Per engine core, from the vLLM-named series (labelled `engine`).
_PER_ENGINE = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_queried_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
}
_GAUGES = {
    "running": "fp4serve_num_requests_running",
    "waiting": "fp4serve_num_requests_waiting",
    "kv_usage": "fp4serve_kv_cache_usage_ratio",
    "kv_pages_total": "fp4serve_kv_cache_pages_total",
    "http_in_flight": "fp4serve_http_requests_in_flight",
    "host_kv_capacity_bytes": "fp4serve_host_kv_capacity_bytes",
    "host_kv_used_bytes": "fp4serve_host_kv_used_bytes",
    "host_kv_pages": "fp4serve_host_kv_pages",
    "host_kv_snapshots": "fp4serve_host_kv_snapshots",
}


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts of one Prometheus histogram: `counts[i]` observations <= `bounds[i]`
    (the last bound is +inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        assert len(self.bounds) == len(self.counts), "one count per bucket bound"

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        if earlier is None:
            return self
        assert earlier.bounds == self.bounds, "histograms with different buckets"
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)))

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation;
        the last finite bound when it lies in the +inf bucket; None with no observations."""
        assert 0.0 <= q <= 1.0, "a quantile is in [0, 1]"
        if self.total <= 0:
            return None
        rank = q * self.total
        i = bisect.bisect_left(self.counts, rank)
        if math.isinf(self.bounds[i]):
            return self.bounds[i - 1] if i > 0 else None
        lower = self.bounds[i - 1] if i > 0 else 0.0
        below = self.counts[i - 1] if i > 0 else 0.0
        in_bucket = self.counts[i] - below
        if in_bucket <= 0:
            return self.bounds[i]
        return lower + (self.bounds[i] - lower) * (rank - below) / in_bucket


@dataclass(frozen=True)
class Snapshot:
    """The cumulative values of one moment (monotonic seconds)."""

    t: float
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    engines: dict[str, dict[str, float]] = field(default_factory=dict)  # engine core -> _PER_ENGINE values


def read_snapshot(
    registries: Iterable[CollectorRegistry], t: float
) -> tuple[Snapshot, dict[str, float], dict[str, float]]:
    """The cumulative values, the current gauges, and finished requests by reason."""
    samples: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    finished: dict[str, float] = {}
    engines: dict[str, dict[str, float]] = {}
    # Series labelled by API key (the fairness issue's per-key usage) are summed over keys here.
    for registry in registries:
        for family in registry.collect():
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "key"}
                if s.name.endswith("_bucket") and "le" in labels:
                    per_le = buckets.setdefault(s.name[: -len("_bucket")], {})
                    le = float(labels["le"])
                    per_le[le] = per_le.get(le, 0.0) + s.value
                elif s.name in _PER_ENGINE and "engine" in labels:
                    engines.setdefault(labels["engine"], {})[_PER_ENGINE[s.name]] = s.value
                elif s.name == "fp4serve_request_success_total":
                    reason = labels["finished_reason"]
                    finished[reason] = finished.get(reason, 0.0) + s.value
                elif not labels:
                    samples[s.name] = samples.get(s.name, 0.0) + s.value
    histograms = {}
    for key, name in _HISTOGRAMS.items():
        pairs = sorted(buckets.get(name, {}).items())
        histograms[key] = Histogram(tuple(b for b, _ in pairs), tuple(c for _, c in pairs))
    counters = {key: samples.get(name, 0.0) for key, name in _COUNTERS.items()}
    gauges = {key: samples.get(name, 0.0) for key, name in _GAUGES.items()}
    return Snapshot(t, counters, histograms, engines), gauges, finished


class StatsWindow:
    """Snapshots of the last `LATENCY_WINDOW_S` and a little more, taken when /stats is read (at
    most one a second); the first is all zeros at start-up, so a window reaching further back
    covers everything since the server started. Touched on the event loop only."""

    def __init__(self, now: float) -> None:
        self._snapshots: list[Snapshot] = [Snapshot(now, {}, {})]

    def add(self, snapshot: Snapshot) -> None:
        if snapshot.t - self._snapshots[-1].t >= MIN_SNAPSHOT_GAP_S:
            self._snapshots.append(snapshot)
        # Keep the newest snapshot at least a full window old: it is where the window starts.
        while len(self._snapshots) > 1 and snapshot.t - self._snapshots[1].t >= LATENCY_WINDOW_S:
            self._snapshots.pop(0)

    def before(self, t: float, age_s: float) -> Snapshot:
        """The newest snapshot at least `age_s` older than `t`, else the oldest one kept."""
        for snapshot in reversed(self._snapshots):
            if t - snapshot.t >= age_s:
                return snapshot
        return self._snapshots[0]


def summarize(window: StatsWindow, registries: Iterable[CollectorRegistry], now: float) -> dict[str, Any]:
    current, gauges, finished = read_snapshot(registries, now)
    rate_from = window.before(now, RATE_WINDOW_S)
    latency_from = window.before(now, LATENCY_WINDOW_S)
    window.add(current)
    c = current.counters
    queried, hits = c["prefix_queried_tokens"], c["prefix_hit_tokens"]
    return {
        "requests": {
            "running": int(gauges["running"]),
            "waiting": int(gauges["waiting"]),
            "http_in_flight": int(gauges["http_in_flight"]),
            "finished": {reason: int(n) for reason, n in sorted(finished.items())},
            "preemptions": int(c["preemptions"]),
        },
        "kv_cache": {"usage": gauges["kv_usage"], "pages_total": int(gauges["kv_pages_total"])},
        "engines": [
            {"engine": int(engine), **{k: (v if k == "kv_usage" else int(v)) for k, v in sorted(values.items())}}
            for engine, values in sorted(current.engines.items(), key=lambda item: int(item[0]))
        ],
        "prefix_cache": {
            "queried_tokens": int(queried),
            "hit_tokens": int(hits),
            "hit_rate": round(hits / queried, 4) if queried else None,
        },
        "host_kv": _host_kv(gauges, c),
        "tokens": {
            "prompt_total": int(c["prompt_tokens"]),
            "generation_total": int(c["generation_tokens"]),
            "prompt_per_s": _rate(current, rate_from, "prompt_tokens"),
            "generation_per_s": _rate(current, rate_from, "generation_tokens"),
            "rate_window_s": round(now - rate_from.t, 3),
        },
        "latency": {
            "window_s": round(now - latency_from.t, 3),
            **{key: _percentiles(h.minus(latency_from.histograms.get(key))) for key, h in current.histograms.items()},
        },
    }


def _host_kv(gauges: dict[str, float], counters: dict[str, float]) -> dict[str, Any] | None:
    """The host KV tier: what it holds and what it served (None when --kv-offloading-size is 0)."""
    if not gauges["host_kv_capacity_bytes"]:
        return None
    held = {key.removeprefix("host_kv_"): int(value) for key, value in gauges.items() if key.startswith("host_kv_")}
    done = {
        key.removeprefix("host_kv_"): (round(value, 6) if key.endswith("seconds") else int(value))
        for key, value in counters.items()
        if key.startswith("host_kv_")
    }
    return {**held, **done}


def _rate(current: Snapshot, earlier: Snapshot, key: str) -> float:
    elapsed = current.t - earlier.t
    return round((current.counters[key] - earlier.counters.get(key, 0.0)) / elapsed, 3) if elapsed > 0 else 0.0


def _percentiles(histogram: Histogram) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {"count": int(histogram.total)}
    for q in QUANTILES:
        value = histogram.quantile(q)
        out[f"p{round(q * 100)}"] = None if value is None else round(value, 6)  # to the microsecond
    return out


class StatsFeed:
    """What /stats serves: one window per app, and the latest summary, which many open dashboards
    share for REUSE_S."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # seconds, monotonic (a test passes its own)
        self.window = StatsWindow(clock())
        self._last: dict[str, Any] | None = None
        self._last_t = 0.0

    def read(self, registries: Iterable[CollectorRegistry]) -> dict[str, Any]:
        now = self.clock()
        if self._last is None or now - self._last_t >= REUSE_S:
            self._last = {"object": "stats", "time": time.time(), **summarize(self.window, registries, now)}
            self._last_t = now
        return self._last

    async def endpoint(self, request: Request) -> Response:
        """NOTE: open like /metrics (api/access/auth.py guards /v1/* only): it shows the same aggregate
        numbers that /metrics shows, and nothing of any request's content or of any key."""
        state = server_state(request)
        # As /metrics: served while draining and after an engine failure; a 503 before it exists.
        engine = state.engine or state.ready_engine()
        body = self.read((engine.metrics.registry, state.metrics.registry))
        return json_response({**body, "status": state.phase})


def stats_routes() -> list[Route]:
    return [Route("/stats", StatsFeed().endpoint, methods=["GET"])]
