"""bench/stats.py and the arrival process of bench/serve.py: percentiles, TPOT, goodput,
summaries and Poisson arrivals, on fixed data with exact expected values."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from bench.serve import Load, arrival_times
from bench.stats import CANCELLED, RequestRecord, Slo, distribution, goodput, percentile, summarize

DATA = {
    "one": [4.0],
    "two": [1.0, 3.0],
    "odd": [7.0, 1.0, 5.0, 3.0, 9.0],
    "ties": [2.0, 2.0, 2.0, 8.0, 8.0, 10.0],
    "skewed": [0.5, 0.6, 0.61, 0.7, 0.9, 1.2, 5.0, 30.0, 31.0, 250.0, 251.5],
}


def make_record(
    index: int = 0,
    *,
    ttft: float | None = 0.1,
    e2e: float | None = 1.0,
    output_tokens: int | None = 10,
    prompt_tokens: int | None = 100,
    itls: tuple[float, ...] = (),
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        send_time=0.0,
        ttft=ttft,
        itls=itls,
        e2e=e2e,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        error=error,
    )


@pytest.mark.parametrize("name", sorted(DATA))
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear_interpolation(name: str, q: float) -> None:
    values = DATA[name]
    assert percentile(sorted(values), q) == pytest.approx(np.percentile(values, q), abs=1e-12)


def test_distribution_reports_mean_p50_p90_p99_max() -> None:
    d = distribution(DATA["odd"])
    assert d == {"mean": 5.0, "p50": 5.0, "p90": pytest.approx(8.2), "p99": pytest.approx(8.92), "max": 9.0}


def test_distribution_of_nothing_is_all_none() -> None:
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


@pytest.mark.parametrize(
    ("ttft", "e2e", "n", "tpot"),
    [
        (0.1, 1.0, 10, 0.1),  # 0.9 s for 9 tokens after the first
        (0.5, 0.5, 2, 0.0),
        (0.2, 2.2, 5, 0.5),
        (0.1, 1.0, 1, None),  # undefined for one token
    ],
)
def test_tpot_is_e2e_minus_ttft_over_tokens_after_the_first(
    ttft: float, e2e: float, n: int, tpot: float | None
) -> None:
    got = make_record(ttft=ttft, e2e=e2e, output_tokens=n).tpot
    assert got == (None if tpot is None else pytest.approx(tpot))


def test_goodput_counts_requests_meeting_every_objective() -> None:
    records = [
        make_record(0, ttft=0.100, e2e=0.100 + 9 * 0.020),  # ttft 100, tpot 20: meets both
        make_record(1, ttft=0.300, e2e=0.300 + 9 * 0.020),  # ttft too slow
        make_record(2, ttft=0.150, e2e=0.150 + 9 * 0.060),  # tpot too slow
        make_record(3, ttft=0.200, e2e=0.200 + 9 * 0.050),  # exactly on both limits
        make_record(4, ttft=0.050, e2e=0.050, output_tokens=1),  # tpot undefined: met
        make_record(5, ttft=None, e2e=None, error="http_500"),
    ]
    slo = Slo(ttft_ms=200, tpot_ms=50)
    assert [slo.met_by(r) for r in records] == [True, False, False, True, True, False]
    assert goodput(records, slo, duration_s=2.0) == 1.5


@pytest.mark.parametrize(
    ("text", "slo"),
    [
        ("ttft=200,tpot=50", Slo(ttft_ms=200, tpot_ms=50)),
        ("e2e=1500", Slo(e2e_ms=1500)),
        ("ttft_ms=10, e2el=20", Slo(ttft_ms=10, e2e_ms=20)),
    ],
)
def test_slo_parses_milliseconds(text: str, slo: Slo) -> None:
    assert Slo.parse(text) == slo


@pytest.mark.parametrize("text", ["", "itl=5", "ttft", "ttft=-1", "ttft=abc"])
def test_bad_slo_is_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        Slo.parse(text)


def test_summary_counts_throughput_and_pooled_itl() -> None:
    records = [
        make_record(0, ttft=0.1, e2e=1.0, output_tokens=10, prompt_tokens=100, itls=(0.1, 0.1, 0.2)),
        make_record(1, ttft=0.3, e2e=2.0, output_tokens=30, prompt_tokens=50, itls=(0.4,)),
        make_record(2, ttft=None, e2e=None, error="http_500", output_tokens=0),
        make_record(3, ttft=None, e2e=None, error="http_500", output_tokens=0),
        make_record(4, ttft=None, e2e=None, error="stream_error", output_tokens=0),
        make_record(5, ttft=0.2, e2e=None, error=CANCELLED, output_tokens=3),
    ]
    s = summarize(records, duration_s=4.0, slo=Slo(ttft_ms=200))
    assert (s["completed"], s["failed"], s["cancelled"]) == (2, 3, 1)
    assert s["errors"] == {"http_500": 2, "stream_error": 1}
    assert s["request_throughput"] == 0.5
    assert s["output_throughput"] == 10.0  # 40 tokens of completed requests in 4 s
    assert s["total_throughput"] == 47.5  # (150 + 40) / 4
    assert s["goodput"] == 0.25
    assert s["concurrency"] == pytest.approx(0.75)  # 3 s of latency over 4 s
    assert s["ttft_ms.mean"] == pytest.approx(200.0)
    assert s["itl_ms.p50"] == pytest.approx(150.0)  # pooled gaps 100, 100, 200, 400
    assert s["itl_ms.max"] == pytest.approx(400.0)
    assert s["tpot_ms.p50"] == pytest.approx((100.0 + 1700.0 / 29) / 2)
    assert s["e2e_ms.max"] == pytest.approx(2000.0)


def test_summary_without_slo_has_no_goodput() -> None:
    s = summarize([make_record()], duration_s=1.0)
    assert s["goodput"] is None and s["slo"] is None


@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_poisson_arrivals_are_reproducible_with_mean_gap_one_over_rate(rate: float) -> None:
    times = arrival_times(rate, 4000, seed=7)
    assert times == arrival_times(rate, 4000, seed=7)
    assert times != arrival_times(rate, 4000, seed=8)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.08)


def test_burstiness_keeps_the_mean_and_narrows_the_spread() -> None:
    times = arrival_times(10.0, 4000, seed=1, burstiness=4.0)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(4.0), rel=0.1)  # gamma of shape k: CV = 1/sqrt(k)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(math.inf, 5, seed=0) == [0.0] * 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"concurrency": 2, "request_rate": 1.0},
        {"concurrency": 0},
        {"request_rate": 0.0},
        {"concurrency": 1, "num_requests": 0},
        {"concurrency": 1, "duration_s": 0.0},
    ],
)
def test_load_needs_exactly_one_positive_load(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Load(**kwargs)  # type: ignore[arg-type]
