"""Statistics of a load run: per-request records in, a flat summary out (percentiles, goodput).

Definitions follow `vllm bench serve` (docs/anchors.md §3): TTFT = send -> first streamed output,
ITL = gaps between output-bearing chunks (pooled over requests), TPOT = (e2e - ttft) / (n - 1).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)
CANCELLED = "cancelled"  # error kind of a request cut off by the time bound or Ctrl-C

SummaryValue = float | int | str | dict[str, int] | None


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured. Times are seconds; `send_time` is relative to the run's start."""

    index: int
    send_time: float
    ttft: float | None  # None when no output arrived
    itls: tuple[float, ...]
    e2e: float | None  # None when the request failed before its stream ended
    prompt_tokens: int | None
    output_tokens: int | None
    usage_counted: bool = False  # True: the server sent no usage; tokens counted from chunks
    error: str | None = None  # kind: "http_500", "stream_error", "ReadTimeout", "cancelled", ...
    error_message: str | None = None
    conversation_id: int = 0
    turn: int = 0
    max_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when it is undefined (n < 2)."""
        if self.ttft is None or self.e2e is None or not self.output_tokens:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, object]:
        def ms(x: float | None) -> float | None:
            return None if x is None else x * 1000.0

        tpot = self.tpot
        return {
            "index": self.index,
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "send_time_s": self.send_time,
            "ttft_ms": ms(self.ttft),
            "itl_ms": [x * 1000.0 for x in self.itls],
            "tpot_ms": ms(tpot),
            "e2e_ms": ms(self.e2e),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_tokens": self.max_tokens,
            "usage": "counted" if self.usage_counted else "server",
            "error": self.error,
            "error_message": self.error_message,
        }


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in milliseconds; a request meets the SLO if it meets
    every objective that is set (DistServe's goodput definition, as vLLM's `--goodput`)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """Parse `ttft=200,tpot=50,e2e=10000` (milliseconds)."""
        values: dict[str, float] = {}
        for item in text.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip().lower().removesuffix("_ms")
            key = "e2e" if key == "e2el" else key
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO item {item!r}: expected ttft=MS, tpot=MS or e2e=MS")
            ms = float(value)
            if not ms > 0:
                raise ValueError(f"SLO {key} must be positive, got {value}")
            values[f"{key}_ms"] = ms
        if not values:
            raise ValueError(f"empty SLO {text!r}")
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft is None or record.e2e is None:
            return False
        if self.ttft_ms is not None and record.ttft * 1000.0 > self.ttft_ms:
            return False
        # NOTE: TPOT is undefined for one-token outputs; like vLLM we count it as met.
        tpot = record.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e * 1000.0 <= self.e2e_ms

    def describe(self) -> str:
        parts = [
            f"{k}<={v:g}ms"
            for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2e", self.e2e_ms))
            if v is not None
        ]
        return ",".join(parts)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks: numpy's
    default ("linear") method. `sorted_values` must be sorted ascending and non-empty."""
    assert sorted_values, "percentile of no values"
    assert 0.0 <= q <= 100.0, f"percentile {q} outside [0, 100]"
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of `values` (all None when there are none)."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    ordered = sorted(values)
    out: dict[str, float | None] = {"mean": math.fsum(ordered) / len(ordered)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ordered, q)
    out["max"] = ordered[-1]
    return out


def goodput(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> float:
    """Requests per second that completed and met every objective of `slo`."""
    assert duration_s > 0, "goodput needs a positive duration"
    return sum(1 for r in records if slo.met_by(r)) / duration_s


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict[str, SummaryValue]:
    """The flat summary of one run: dotted keys such as `ttft_ms.p99`, throughputs per second of
    `duration_s` (the run's wall time), counts and errors by kind."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.error != CANCELLED]
    duration = max(duration_s, 1e-9)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    summary: dict[str, SummaryValue] = {
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": sum(1 for r in records if r.error == CANCELLED),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (prompt_tokens + output_tokens) / duration,
        "goodput": None if slo is None else goodput(records, slo, duration),
        "slo": None if slo is None else slo.describe(),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        # Mean requests in flight (Little's law), as sglang.bench_serving reports it.
        "concurrency": math.fsum(r.e2e for r in ok if r.e2e is not None) / duration,
        "usage_counted": sum(1 for r in ok if r.usage_counted),
    }
    series: dict[str, list[float]] = {
        "ttft_ms": [r.ttft * 1000.0 for r in ok if r.ttft is not None],
        "itl_ms": [x * 1000.0 for r in ok for x in r.itls],
        "tpot_ms": [t * 1000.0 for r in ok if (t := r.tpot) is not None],
        "e2e_ms": [r.e2e * 1000.0 for r in ok if r.e2e is not None],
        "prompt_tokens": [float(r.prompt_tokens) for r in ok if r.prompt_tokens is not None],
        "output_tokens": [float(r.output_tokens) for r in ok if r.output_tokens is not None],
    }
    for name, values in series.items():
        for stat, value in distribution(values).items():
            summary[f"{name}.{stat}"] = value
    summary["errors"] = dict(Counter(r.error for r in failed if r.error is not None))
    return summary
