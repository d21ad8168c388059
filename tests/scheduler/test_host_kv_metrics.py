"""The host KV tier seen from outside, without a model: each core's `SchedulerStats.host` becomes
vLLM's offloading series (bytes and time by transfer_type, external prefix-cache queries and hits,
labelled model_name and engine) and our fp4serve_host_kv_* series, and /stats shows the tier
(null when it is off); the web page has its tile."""

from __future__ import annotations

import importlib.resources

from prometheus_client import CollectorRegistry

from api.ops.stats import StatsWindow, summarize
from engine.front.metrics import EngineMetrics
from scheduler.output import HostTierStats, SchedulerStats

PAGE, SNAP = 1024, 4096


def report(engine: EngineMetrics, host: HostTierStats | None, index: int = 0) -> None:
    engine.observe_scheduler(SchedulerStats(0, 0, 4, 64, 100, 40, 0, host=host), index)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no {name}{labels}"
    return value


def test_the_tier_reports_under_vllms_offloading_names_and_ours() -> None:
    engine = EngineMetrics("m", num_engines=2)
    report(
        engine,
        HostTierStats(
            100,
            10,
            8,
            1,
            PAGE,
            SNAP,
            hit_tokens=64,
            queried_tokens=80,
            loaded_pages=4,
            spilled_pages=10,
            loaded_snapshots=1,
            spilled_snapshots=1,
            load_seconds=0.5,
            spill_seconds=0.25,
        ),
        index=1,
    )
    report(
        engine,
        HostTierStats(
            100,
            12,
            8,
            2,
            PAGE,
            SNAP,
            hit_tokens=96,
            queried_tokens=120,
            loaded_pages=6,
            spilled_pages=12,
            loaded_snapshots=1,
            spilled_snapshots=2,
            load_seconds=0.75,
            spill_seconds=0.25,
        ),
        index=1,
    )
    r, core = engine.registry, {"model_name": "m", "engine": "1"}
    assert sample(r, "vllm:kv_offload_total_bytes_total", **core, transfer_type="GPU_to_CPU") == 12 * PAGE + 2 * SNAP
    assert sample(r, "vllm:kv_offload_total_bytes_total", **core, transfer_type="CPU_to_GPU") == 6 * PAGE + SNAP
    assert sample(r, "vllm:kv_offload_total_time_total", **core, transfer_type="CPU_to_GPU") == 0.75
    assert sample(r, "vllm:external_prefix_cache_queries_total", **core) == 120
    assert sample(r, "vllm:external_prefix_cache_hits_total", **core) == 96
    assert sample(r, "fp4serve_host_kv_capacity_bytes") == 100 * PAGE + 8 * SNAP
    assert sample(r, "fp4serve_host_kv_used_bytes") == 12 * PAGE + 2 * SNAP
    assert (sample(r, "fp4serve_host_kv_pages"), sample(r, "fp4serve_host_kv_snapshots")) == (12, 2)
    assert sample(r, "fp4serve_host_kv_page_loads_total") == 6
    assert sample(r, "fp4serve_host_kv_snapshot_spills_total") == 2


def test_stats_show_the_host_tier_and_null_without_one() -> None:
    off = EngineMetrics("m")
    report(off, None)
    assert summarize(StatsWindow(0.0), [off.registry], now=1.0)["host_kv"] is None
    on = EngineMetrics("m")
    report(
        on,
        HostTierStats(
            100,
            12,
            8,
            2,
            PAGE,
            SNAP,
            hit_tokens=96,
            queried_tokens=120,
            loaded_pages=6,
            spilled_pages=12,
            loaded_snapshots=1,
            spilled_snapshots=2,
            load_seconds=0.75,
        ),
    )
    host = summarize(StatsWindow(0.0), [on.registry], now=1.0)["host_kv"]
    assert host == {
        "capacity_bytes": 100 * PAGE + 8 * SNAP,
        "used_bytes": 12 * PAGE + 2 * SNAP,
        "pages": 12,
        "snapshots": 2,
        "hit_tokens": 96,
        "page_loads": 6,
        "page_spills": 12,
        "snapshot_loads": 1,
        "snapshot_spills": 2,
        "load_seconds": 0.75,
    }


def test_the_dashboard_has_a_host_tier_tile_fed_by_stats() -> None:
    static = importlib.resources.files("api") / "static"
    assert 'id="metric-host-kv"' in (static / "index.html").read_text()
    script = (static / "dashboard.js").read_text()
    assert "s.host_kv" in script and "metric-host-kv" in script
