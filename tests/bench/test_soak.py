"""`python -m bench soak`: a short real run against the spawned demo server passes (every greedy
answer equals its reference, nothing leaks, the server exits 0 on SIGTERM), and the verdict fails
on each kind of problem a soak exists to catch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from bench.__main__ import main
from bench.soak import EndState, Outcome, SoakConfig, SoakReport, Tally, format_report, refusal
from tests.server_utils import REPO

MIB = 1 << 20


@pytest.mark.slow
def test_a_short_soak_against_the_spawned_demo_server_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--spawn", "--duration", "8", "--concurrency", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "PASS" and len(lines) <= 24
    traffic = next(line for line in lines if line.startswith("traffic"))
    assert traffic.endswith(" 0 failed") and " 0 walked away" not in traffic and " 0 refused" not in traffic
    assert "idle       running 0, waiting 0, KV pages held 0" in done.stdout
    assert "from /metrics" in done.stdout and "server     exited 0 after SIGTERM" in done.stdout
    greedy = next(line for line in lines if line.startswith("greedy"))
    assert int(greedy.split()[1]) > 0


def clean_report(**end: object) -> SoakReport:
    tally = Tally()
    tally.counts.update(greedy=10, ok=5, refused=3, disconnected=2)
    state = EndState(
        num_running=0,
        num_waiting=0,
        kv_pages_held=0,
        settled_s=0.1,
        rss_warm=800 * MIB,
        rss_end=810 * MIB,
        rss_source="/metrics",
        exit_code=0,
    )
    return SoakReport(
        SoakConfig(base_url="http://h/v1", model="m", max_rss_growth_mib=64), tally, replace(state, **end), "external"
    )


def test_a_clean_run_passes() -> None:
    report = clean_report()
    assert report.failures() == []
    assert format_report(report).splitlines()[-1] == "PASS"


@pytest.mark.parametrize(
    ("end", "words"),
    [
        ({"num_running": 2.0}, "running is 2 after"),
        ({"num_waiting": 1.0}, "waiting is 1 after"),
        ({"kv_pages_held": 3.0}, "KV pages held is 3 after"),
        ({"rss_end": 900 * MIB}, "resident memory grew 100.0 MiB (limit 64 MiB)"),
        ({"exit_code": 1}, "exited 1 after SIGTERM"),
    ],
)
def test_a_leak_or_an_unclean_exit_fails_the_run(end: dict[str, object], words: str) -> None:
    report = clean_report(**end)
    assert len(report.failures()) == 1 and words in report.failures()[0]
    text = format_report(report)
    assert text.splitlines()[-1] == "FAIL" and words in text


def test_a_wrong_greedy_answer_or_no_greedy_answer_at_all_fails_the_run() -> None:
    report = clean_report()
    report.tally.fail("greedy answer for 'x': 'a' != reference 'b'")
    assert report.failures() == ["greedy answer for 'x': 'a' != reference 'b'"]
    assert report.tally.counts["failed"] == 1
    report.tally.counts["greedy"] = 0
    assert "no greedy answer was checked (all refused?)" in report.failures()


def test_metrics_that_are_not_ours_are_reported_not_failed() -> None:
    report = clean_report(num_running=None, num_waiting=None, kv_pages_held=None, rss_warm=None, rss_end=None)
    assert report.failures() == []
    assert "n/a (no fp4serve metrics)" in format_report(report)


ERROR = b'{"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": null}}'


@pytest.mark.parametrize(
    ("status", "headers", "body", "expected"),
    [
        (400, {}, ERROR, Outcome("refused")),
        (404, {}, ERROR, Outcome("refused")),
        (503, {"retry-after": "1"}, ERROR, Outcome("overloaded", retry_after_s=1.0)),
        (503, {"retry-after": "120"}, ERROR, Outcome("overloaded", retry_after_s=5.0)),
        (503, {}, ERROR, Outcome("failed", "x: 503 without a Retry-After in seconds")),
        (500, {}, ERROR, Outcome("failed", f"x: 500 {ERROR[:160]!r}")),
        (400, {}, b'{"detail": "no"}', Outcome("failed", 'x: 400 without an OpenAI error body: b\'{"detail": "no"}\'')),
    ],
)
def test_refusals_count_only_in_openai_shape(
    status: int, headers: dict[str, str], body: bytes, expected: Outcome
) -> None:
    assert refusal(status, httpx.Headers(headers), body, "x") == expected


def test_soak_needs_exactly_one_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak"]) == 2
    assert main(["soak", "--spawn", "--base-url", "http://127.0.0.1:1/v1"]) == 2
    assert "give --base-url or --spawn" in capsys.readouterr().err
