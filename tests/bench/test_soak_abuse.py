"""`python -m bench soak --abuse`: a short real run against the spawned demo server passes and draws
its chart, and the verdict fails on each thing the abuse soak exists to catch (a well-behaved request
failing, a smuggled request running, a 5xx, the grammar cache over its budget, requests left in
flight)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.abuse_soak import AbuseSoakConfig, AbuseSoakResult, format_abuse_report
from tests.server_utils import REPO

CONFIG = AbuseSoakConfig(root_url="http://h:1", model="m", user_key="u", abuser_key="a")


def clean() -> AbuseSoakResult:
    return AbuseSoakResult(
        ttfts=[(1.0, 0.2), (2.0, 0.3)],
        outcomes=Counter({"smuggle 400+closed": 3, "oversized_h2 413": 2}),
        samples=[{"t": 0.0, "engine_rss_mib": 700.0, "grammar_cache_mib": 10.0, "grammar_budget_mib": 128.0}],
        in_flight_after=0.0,
    )


def test_a_clean_run_passes_and_reports_ttft_and_memory() -> None:
    text = format_abuse_report(CONFIG, clean(), None)
    assert text.splitlines()[-1] == "PASS"
    assert "TTFT p50 250 ms, p99 299 ms" in text and "engine RSS    700 MiB at the start" in text
    assert "grammar cache peak 10.0 MiB (and 0.0 MiB held past it) of a 128 MiB budget" in text


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: r.user_failures.append("429 b'...'"), "well-behaved: 429"),
        (
            lambda r: r.outcomes.update({"FAIL smuggle: the hidden request ran": 1}),
            "FAIL smuggle: the hidden request ran (x1)",
        ),
        (lambda r: r.outcomes.update({"FAIL huge_enum 500": 2}), "FAIL huge_enum 500 (x2)"),
        (
            lambda r: r.samples.append({"t": 1.0, "grammar_cache_mib": 130.0, "grammar_budget_mib": 128.0}),
            "grammar cache 130.0 MiB, over its budget",
        ),
        (lambda r: setattr(r, "in_flight_after", 2.0), "2 requests still in flight"),
        (lambda r: r.ttfts.clear(), "no well-behaved request finished"),
    ],
)
def test_each_problem_fails_the_run(change: object, words: str) -> None:
    result = clean()
    change(result)  # type: ignore[operator]
    assert len(result.failures()) == 1 and words in result.failures()[0]
    assert format_abuse_report(CONFIG, result, None).splitlines()[-1] == "FAIL"


@pytest.mark.slow
def test_a_short_abuse_soak_against_the_spawned_demo_server_passes(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "soak",
            "--spawn",
            "--abuse",
            "--duration",
            "5",
            "--streams",
            "1",
            "--abusers",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-2] == "PASS" and "exited 0 after SIGTERM" in done.stdout
    doc = json.loads((tmp_path / "soak_abuse.json").read_text())
    assert doc["ttfts"] and doc["failures"] == [] and any("engine_rss_mib" in s for s in doc["samples"])
    assert (tmp_path / "soak_abuse.png").stat().st_size > 10_000
