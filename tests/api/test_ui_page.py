"""The web page's HTTP side without a browser: `GET /` and /ui/* with their security headers,
`--no-ui`, what the page's files may not contain, and /stats (api/ops/stats.py): histogram
percentiles, rates and windows on the engine's real metrics, and the route on a real server."""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from api.app import ServerConfig, build_app
from api.cli import build_parser, server_config
from api.ops.stats import LATENCY_WINDOW_S, REUSE_S, Histogram, StatsFeed, StatsWindow, read_snapshot, summarize
from api.ops.ui import CONTENT_SECURITY_POLICY
from api.transport.metrics import ServerMetrics
from engine.config import EngineConfig
from engine.front.metrics import EngineMetrics
from scheduler.output import SchedulerStats
from tests.server_utils import InProcessServer, in_process_server

STATIC = importlib.resources.files("api") / "static"
INF = float("inf")


def no_engine(config: EngineConfig) -> Any:
    raise RuntimeError("no engine in this test")


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(build_app(ServerConfig(engine=EngineConfig()), loader=no_engine)) as test_client:
        yield test_client


def test_the_page_and_its_files_are_served_with_a_strict_csp(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert 'data-testid="dashboard"' in page.text
    for path, media_type in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp and "require-trusted-types-for 'script'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/ui/missing.js").status_code == 404
    assert client.get("/ui/..%2Fapp.py").status_code == 404


def test_no_ui_leaves_the_page_out_but_keeps_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP4SERVE_API_KEY", raising=False)
    args = build_parser(["serve"]).parse_args
    assert server_config(args(["serve"])).ui is True
    config = server_config(args(["serve", "--no-ui"]))
    assert config.ui is False
    with TestClient(build_app(config, loader=no_engine)) as client:
        assert client.get("/").status_code == 404
        assert client.get("/ui/app.js").status_code == 404
        # /stats answers as /metrics does before an engine exists: 503 with an OpenAI error body.
        stats = client.get("/stats")
        assert stats.status_code == 503 and stats.json()["error"]["type"]


def test_the_page_and_stats_need_no_key_but_the_api_does() -> None:
    config = ServerConfig(engine=EngineConfig(), api_key="secret")
    with TestClient(build_app(config, loader=no_engine)) as client:
        assert client.get("/").status_code == 200
        assert client.get("/ui/app.js").status_code == 200
        assert client.get("/stats").status_code == 503  # not 401: open like /metrics
        assert client.get("/v1/models").status_code == 401


def test_the_page_loads_nothing_from_elsewhere_and_never_parses_strings_as_html() -> None:
    files = {entry.name: entry.read_text() for entry in STATIC.iterdir()}
    assert {"index.html", "app.js", "chat.js", "markdown.js", "dashboard.js", "style.css"} <= set(files)
    for name, text in files.items():
        text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
        outside = re.search(r"https?://|(src|href)\s*=\s*[\"']//|@import|url\(", text)
        assert not outside, f"{name} refers to an outside URL"
        if name.endswith(".js"):
            sinks = re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", text)
            assert sinks == [], f"{name} uses {sinks}"
    html = files["index.html"]
    assert not re.search(r"\son\w+=|\sstyle=|<script>|<style", html), "inline script, style or handler in the page"


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.25, 0.15), (0.5, 0.2), (0.625, 0.3), (0.75, 0.4), (1.0, 0.5)],
)
def test_histogram_quantile_interpolates_within_a_bucket_as_prometheus(q: float, expected: float) -> None:
    # 4 observations: 2 in (0.1, 0.2], 1 in (0.2, 0.4], 1 in (0.4, 0.5].
    histogram = Histogram((0.1, 0.2, 0.4, 0.5, INF), (0, 2, 3, 4, 4))
    assert histogram.quantile(q) == pytest.approx(expected)


def test_histogram_quantile_edge_cases() -> None:
    assert Histogram((0.1, INF), (0, 0)).quantile(0.5) is None
    assert Histogram((0.1, 1.0, INF), (0, 1, 4)).quantile(0.99) == 1.0  # in +inf: the last finite bound
    later = Histogram((0.1, 1.0, INF), (3, 5, 5))
    assert later.minus(Histogram((0.1, 1.0, INF), (3, 3, 3))).counts == (0, 2, 2)


def observe_step(engine: EngineMetrics, running: int, prefix: tuple[int, int] = (0, 0)) -> None:
    engine.observe_scheduler(
        SchedulerStats(
            num_running=running,
            num_waiting=2,
            num_used_blocks=16,
            num_blocks=64,
            prefix_cache_queried_tokens=prefix[0],
            prefix_cache_hit_tokens=prefix[1],
            num_preemptions=0,
        )
    )


def test_stats_summarize_the_engine_metrics_with_rates_and_a_latency_window() -> None:
    engine, server = EngineMetrics("m"), ServerMetrics()
    registries = (engine.registry, server.registry)
    window = StatsWindow(now=0.0)
    engine.ttft.labels(key="alice").observe(5.0)  # an old, slow first token: outside the window later
    engine.generation_tokens.labels(key="alice").inc(60)  # per-key series are summed over keys
    engine.generation_tokens.labels(key="bob").inc(40)
    observe_step(engine, running=3, prefix=(400, 100))
    first = summarize(window, registries, now=10.0)
    assert first["requests"] == {"running": 3, "waiting": 2, "http_in_flight": 0, "finished": {}, "preemptions": 0}
    assert first["kv_cache"] == {"usage": 0.25, "pages_total": 64}
    assert first["prefix_cache"] == {"queried_tokens": 400, "hit_tokens": 100, "hit_rate": 0.25}
    assert first["tokens"]["generation_total"] == 100
    assert first["tokens"]["generation_per_s"] == pytest.approx(10.0)  # since start: 100 tokens in 10 s
    assert first["latency"]["ttft_s"]["count"] == 1 and first["latency"]["ttft_s"]["p50"] > 2.5

    later = 10.0 + LATENCY_WINDOW_S + 5
    for t in range(11, int(later)):  # a dashboard polling once a second
        summarize(window, registries, now=float(t))
    engine.generation_tokens.labels(key="bob").inc(50)
    engine.ttft.labels(key="bob").observe(0.03)
    engine.itl.observe(0.015)
    engine.requests_finished.labels(finished_reason="stop", key="bob").inc()
    observe_step(engine, running=0, prefix=(400, 100))
    last = summarize(window, registries, now=later)
    assert last["requests"]["running"] == 0 and last["requests"]["finished"] == {"stop": 1}
    assert last["tokens"]["generation_per_s"] == pytest.approx(50 / 5) and last["tokens"]["rate_window_s"] == 5
    ttft = last["latency"]["ttft_s"]
    assert last["latency"]["window_s"] == LATENCY_WINDOW_S
    assert ttft["count"] == 1 and 0.02 < ttft["p50"] <= 0.04 and ttft["p99"] <= 0.04  # the 5 s one aged out
    assert last["latency"]["itl_s"]["count"] == 1
    assert len(window._snapshots) <= LATENCY_WINDOW_S + 2  # bounded however long it polls


def test_read_snapshot_takes_counters_and_histograms_by_name() -> None:
    engine = EngineMetrics("m")
    engine.prompt_tokens.labels(key="alice").inc(3)
    engine.prompt_tokens.labels(key="default").inc(4)
    engine.e2e.observe(0.3)
    snapshot, gauges, _ = read_snapshot([engine.registry], t=1.0)
    assert snapshot.counters["prompt_tokens"] == 7
    e2e = snapshot.histograms["e2e_s"]
    assert e2e.bounds[-1] == INF and e2e.total == 1 and e2e.quantile(1.0) == 0.5
    assert gauges["running"] == 0


def test_dashboards_polling_together_share_one_reading() -> None:
    engine = EngineMetrics("m")
    now = [100.0]
    feed = StatsFeed(clock=lambda: now[0])
    first = feed.read([engine.registry])
    engine.generation_tokens.labels(key="default").inc(5)
    now[0] += REUSE_S / 2
    assert feed.read([engine.registry]) is first
    now[0] += REUSE_S / 2
    assert feed.read([engine.registry])["tokens"]["generation_total"] == 5


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with in_process_server(ServerConfig(engine=EngineConfig(kv_cache_memory="32MiB", max_model_len=512))) as running:
        yield running


def metric_over_keys(text: str, name: str) -> float:
    """A Prometheus series summed over its `key` label values (the per-key usage series)."""
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    assert values, f"{name} not in /metrics"
    return sum(values)


@pytest.mark.slow
def test_stats_on_a_real_server_agree_with_metrics(server: InProcessServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        before = http.get("/stats").json()
        reply = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
        )
        assert reply.status_code == 200
        stats = before
        while stats["time"] == before["time"]:  # a newer reading (dashboards share one for REUSE_S)
            stats = http.get("/stats").json()
        metrics = http.get("/metrics").text
    assert stats["object"] == "stats" and stats["status"] == "ready"
    assert stats["tokens"]["generation_total"] == before["tokens"]["generation_total"] + 8
    assert stats["tokens"]["generation_total"] == metric_over_keys(metrics, "fp4serve_generation_tokens_total")
    assert stats["tokens"]["prompt_total"] == metric_over_keys(metrics, "fp4serve_prompt_tokens_total")
    assert stats["requests"]["running"] == 0 and stats["requests"]["finished"]["length"] >= 1
    assert stats["latency"]["ttft_s"]["count"] >= 1 and stats["latency"]["ttft_s"]["p50"] > 0
    assert stats["latency"]["itl_s"]["count"] >= 7


def test_without_chromium_and_without_root_the_browser_tests_skip_saying_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tests.browser

    monkeypatch.setattr(tests.browser.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    monkeypatch.setattr(tests.browser.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium chromium-driver"):
        tests.browser.ensure_chromium()
