"""With several engine cores (--data-parallel-size), /metrics serves each `vllm:` series per core
(`engine` label) and also summed over the cores without it, in the same family: counts summed,
histograms merged bucket by bucket, the KV usage as pages used over all the pages (not a mean of
the cores' ratios), info gauges kept at 1. One core: no aggregate series at all."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.front.metrics import EngineMetrics
from scheduler.output import SchedulerStats

MODEL = "m"


def exposed(metrics: EngineMetrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of the served text (parsed back, so the text is valid), by name then labels."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    names = []
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        names.append(family.name)
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    assert len(names) == len(set(names)), "a family served twice"
    return out


def two_cores() -> EngineMetrics:
    metrics = EngineMetrics(MODEL, num_engines=2)
    # Core 0: 100 pages, 10 used; core 1: 300 pages, 90 used.
    metrics.observe_scheduler(SchedulerStats(3, 1, 10, 100, 40, 8, 1), 0)
    metrics.observe_scheduler(SchedulerStats(2, 4, 90, 300, 60, 32, 0), 1)
    metrics.vllm[0].observe_first_token(0.003, 12, 1)
    metrics.vllm[1].observe_first_token(0.03, 20, 1)
    metrics.vllm[1].observe_first_token(3.0, 5, 1)
    return metrics


def test_each_vllm_series_gets_an_engine_less_sum_over_the_cores() -> None:
    samples = exposed(two_cores())
    whole = (("model_name", MODEL),)

    def per_core(name: str) -> list[float]:
        return [samples[name][(("engine", e), ("model_name", MODEL))] for e in ("0", "1")]

    assert per_core("vllm:num_requests_running") == [3, 2]
    assert samples["vllm:num_requests_running"][whole] == 5
    assert samples["vllm:num_requests_waiting"][whole] == 5
    assert samples["vllm:prefix_cache_queries_total"][whole] == 100
    assert samples["vllm:prefix_cache_hits_total"][whole] == 40
    assert samples["vllm:num_preemptions_total"][whole] == 1
    assert samples["vllm:prompt_tokens_total"][whole] == 37
    # Pages used over all the pages: 100 / 400 (the mean of the ratios would be 0.2).
    assert per_core("vllm:kv_cache_usage_perc") == [0.1, 0.3]
    assert samples["vllm:kv_cache_usage_perc"][whole] == 0.25
    assert samples["vllm:gpu_cache_usage_perc"][whole] == 0.25
    # Histograms merged by bucket bound, with their count and sum.
    ttft = samples["vllm:time_to_first_token_seconds_bucket"]
    assert ttft[(("le", "0.005"), ("model_name", MODEL))] == 1
    assert ttft[(("le", "0.04"), ("model_name", MODEL))] == 2
    assert ttft[(("le", "+Inf"), ("model_name", MODEL))] == 3
    assert samples["vllm:time_to_first_token_seconds_count"][whole] == 3
    assert abs(samples["vllm:time_to_first_token_seconds_sum"][whole] - 3.033) < 1e-9
    # Labels other than `engine` stay: one aggregate per finished reason.
    success = samples["vllm:request_success_total"]
    assert success[(("finished_reason", "length"), ("model_name", MODEL))] == 0
    # A series that never had an engine label is left as it is (it is the server's already).
    assert all("engine" not in dict(labels) for labels in samples["vllm:lora_requests_info"])
    assert len(samples["vllm:lora_requests_info"]) == 1
    # Our own series are sums already: nothing added to them.
    assert list(samples["fp4serve_num_requests_running"]) == [()]


def test_usage_weighs_each_core_by_its_pages_as_they_change() -> None:
    metrics = two_cores()
    metrics.observe_scheduler(SchedulerStats(0, 0, 300, 300, 60, 32, 0), 1)  # core 1 full
    assert exposed(metrics)["vllm:kv_cache_usage_perc"][(("model_name", MODEL),)] == 310 / 400


def test_one_core_serves_no_aggregate() -> None:
    metrics = EngineMetrics(MODEL, num_engines=1)
    metrics.observe_scheduler(SchedulerStats(3, 1, 10, 100, 40, 8, 1), 0)
    samples = exposed(metrics)
    assert list(samples["vllm:num_requests_running"]) == [(("engine", "0"), ("model_name", MODEL))]
