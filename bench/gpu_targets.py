"""The device run's verdict: reads the JSON reports `scripts/gpu_check.sh` leaves in one folder
(kernels.json from bench.kernels --sweep, bench-8b.json, bench-hybrid.json and bench-moe.json from
bench.gpu) and checks each figure against its target, one line per check, as targets.json beside
them. A report that is missing or was cut short makes its checks "missing", never "pass".

    python -m bench.gpu_targets OUT_FOLDER [--out OUT_FOLDER/targets.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The decode step at its floor (36 layers, 1k context, graphs): step / floor at batch 1.
STEP_OVER_FLOOR = {"bf16": 1.3, "nvfp4": 1.6}
NVFP4_OVER_BF16_STEP = 0.5  # NVFP4's graph step at most this share of bf16's, at batch 1 and 16
BF16_OUTPUT_TOK_S = 4500.0  # 64 x 1000 in / 500 out through the engine
NVFP4_OVER_BF16_TOK_S = 1.3
HYBRID_STEP_OVER_FLOOR = 2.0  # the hybrid's graph step at 4 layers, batch 1/16/64
VERIFY_OVER_PLAIN = 1.15  # a 3-draft verify step against a plain step, batch 1 and 16


@dataclass(frozen=True)
class Check:
    item: str  # the deliverable it belongs to
    what: str
    value: float | None  # None: no figure in the reports
    target: str
    verdict: str  # "pass", "FAIL" or "missing"


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _check(item: str, what: str, value: float | None, limit: float, at_most: bool) -> Check:
    target = f"{'<=' if at_most else '>='} {limit:g}"
    if value is None:
        return Check(item, what, None, target, "missing")
    ok = value <= limit if at_most else value >= limit
    return Check(item, what, round(value, 3), target, "pass" if ok else "FAIL")


def _step(report: dict[str, Any] | None, fmt: str, batch: int) -> dict[str, Any] | None:
    rows = report.get("steps", []) if report else []
    return next((r for r in rows if r["format"] == fmt and r["batch_size"] == batch), None)


def _graph_ms(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row.get("graph_ms")


def kernel_checks(kernels: dict[str, Any] | None) -> list[Check]:
    """Item 1: every (shape, M) point of the sweep against its speed target over cuBLAS bf16."""
    if kernels is None:
        return [Check("1 kernel", "NVFP4 W4A16 sweep", None, "every point", "missing")]
    return [
        Check(
            "1 kernel",
            f"{r['shape']} M={r['m']} speed over bf16",
            round(r["speedup"], 3),
            f">= {r['target']:g}",
            "pass" if r["passed"] else "FAIL",
        )
        for r in kernels.get("rows", [])
    ]


def step_checks(dense: dict[str, Any] | None) -> list[Check]:
    """Item 3: Qwen3-8B's graph step against its floor, and NVFP4's against bf16's."""
    checks = []
    for fmt, limit in STEP_OVER_FLOOR.items():
        row = _step(dense, fmt, 1)
        ratio = None if _graph_ms(row) is None else row["graph_ms"] / row["floor_ms"]  # type: ignore[index]
        checks.append(_check("3 step", f"{fmt} batch 1 graph step / floor", ratio, limit, at_most=True))
    for batch in (1, 16):
        bf16, nvfp4 = _graph_ms(_step(dense, "bf16", batch)), _graph_ms(_step(dense, "nvfp4", batch))
        ratio = nvfp4 / bf16 if bf16 and nvfp4 else None
        checks.append(
            _check("3 step", f"nvfp4 / bf16 graph step at batch {batch}", ratio, NVFP4_OVER_BF16_STEP, at_most=True)
        )
    return checks


def throughput_checks(dense: dict[str, Any] | None) -> list[Check]:
    """Item 4: the engine's output tokens/s, bf16 and NVFP4 over bf16."""
    rows = {
        r["format"]: r["output_tokens_per_s"] for r in (dense or {}).get("throughput", []) if r["system"] == "fp4serve"
    }
    bf16, nvfp4 = rows.get("bf16"), rows.get("nvfp4")
    return [
        _check("4 throughput", "bf16 output tok/s", bf16, BF16_OUTPUT_TOK_S, at_most=False),
        _check(
            "4 throughput",
            "nvfp4 / bf16 output tok/s",
            nvfp4 / bf16 if bf16 and nvfp4 else None,
            NVFP4_OVER_BF16_TOK_S,
            at_most=False,
        ),
    ]


def graph_checks(hybrid: dict[str, Any] | None, moe: dict[str, Any] | None) -> list[Check]:
    """Item 5: the hybrid's graph step against its floor; the MoE model replays graphs at all."""
    checks = []
    for batch in (1, 16, 64):
        row = _step(hybrid, "nvfp4", batch)
        ratio = None if _graph_ms(row) is None else row["graph_ms"] / row["floor_ms"]  # type: ignore[index]
        checks.append(
            _check(
                "5 hybrid/MoE graphs",
                f"hybrid batch {batch} graph step / floor",
                ratio,
                HYBRID_STEP_OVER_FLOOR,
                at_most=True,
            )
        )
    captured = [r for r in (moe or {}).get("steps", []) if r.get("graph_ms") is not None]
    checks.append(
        Check(
            "5 hybrid/MoE graphs",
            "MoE decode steps replayed from graphs",
            len(captured) if moe else None,
            ">= 1",
            "missing" if moe is None else "pass" if captured else "FAIL",
        )
    )
    return checks


def verify_checks(dense: dict[str, Any] | None, hybrid: dict[str, Any] | None) -> list[Check]:
    """Item 6: a verify step of 3 drafts per request against a plain step, batch 1 and 16."""
    checks = []
    for name, report, fmt in (("Qwen3-8B", dense, "nvfp4"), ("hybrid", hybrid, "nvfp4")):
        for batch in (1, 16):
            row = _step(report, fmt, batch)
            checks.append(
                _check(
                    "6 verify",
                    f"{name} batch {batch} verify / plain step",
                    None if row is None else row.get("verify_over_plain"),
                    VERIFY_OVER_PLAIN,
                    at_most=True,
                )
            )
    return checks


def evaluate(folder: Path) -> list[Check]:
    dense, hybrid = _load(folder, "bench-8b.json"), _load(folder, "bench-hybrid.json")
    return [
        *kernel_checks(_load(folder, "kernels.json")),
        *step_checks(dense),
        *throughput_checks(dense),
        *graph_checks(hybrid, _load(folder, "bench-moe.json")),
        *verify_checks(dense, hybrid),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="where gpu_check.sh wrote its JSON reports ($OUT)")
    p.add_argument("--out", help="the verdict as JSON (default: FOLDER/targets.json)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    checks = evaluate(folder)
    for c in checks:
        value = "-" if c.value is None else f"{c.value:g}"
        print(f"{c.verdict:7} {c.item:20} {c.what:45} {value:>9} (target {c.target})")
    counts = {v: sum(c.verdict == v for c in checks) for v in ("pass", "FAIL", "missing")}
    print(f"targets: {counts['pass']} pass, {counts['FAIL']} fail, {counts['missing']} missing")
    Path(args.out or folder / "targets.json").write_text(
        json.dumps({"counts": counts, "checks": [asdict(c) for c in checks]}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
