"""Results as people and tools read them: the JSON document of a run (`config`, `summary`,
`requests`), the end-of-run table, the sweep table and the side-by-side comparison."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import orjson

from bench.stats import RequestRecord, SummaryValue

Result = dict[str, object]  # one run's document: {"config", "summary", "requests"}

LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
COLUMNS = ("mean", "p50", "p90", "p99", "max")
# (row title, summary key, higher is better) for `compare`.
COMPARED = (
    ("request throughput (req/s)", "request_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    ("total throughput (tok/s)", "total_throughput", True),
    ("goodput (req/s)", "goodput", True),
    ("TTFT p50 (ms)", "ttft_ms.p50", False),
    ("TTFT p99 (ms)", "ttft_ms.p99", False),
    ("ITL p50 (ms)", "itl_ms.p50", False),
    ("ITL p99 (ms)", "itl_ms.p99", False),
    ("TPOT p50 (ms)", "tpot_ms.p50", False),
    ("TPOT p99 (ms)", "tpot_ms.p99", False),
    ("E2E p50 (ms)", "e2e_ms.p50", False),
    ("E2E p99 (ms)", "e2e_ms.p99", False),
    ("completed", "completed", True),
    ("failed", "failed", False),
)


def result_document(
    config: dict[str, object], summary: dict[str, SummaryValue], records: Sequence[RequestRecord]
) -> Result:
    return {"config": config, "summary": summary, "requests": [r.to_dict() for r in records]}


def write_results(path: str | Path, results: Sequence[Result]) -> None:
    """One run as one object; a sweep as a list of them, in load order."""
    doc: object = results[0] if len(results) == 1 else list(results)
    Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def load_results(path: str | Path) -> list[Result]:
    doc = orjson.loads(Path(path).read_bytes())
    runs = doc if isinstance(doc, list) else [doc]
    for run in runs:
        if not (isinstance(run, dict) and "summary" in run and "config" in run):
            raise ValueError(f"{path}: not a bench result (needs `config` and `summary`)")
    return runs


def run_label(result: Result, fallback: str = "") -> str:
    """The run's name for legends and headers: its --label, else `fallback` (a file stem)."""
    label = _config(result).get("label")
    return str(label) if label else fallback


def load_label(result: Result) -> str:
    return str(_config(result).get("load_label", ""))


def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def format_summary(result: Result) -> str:
    """The table printed at the end of one run."""
    cfg, s = _config(result), _summary(result)
    dataset = cfg.get("dataset") or {}
    assert isinstance(dataset, dict)
    title = f" {run_label(result, 'bench')}: {cfg.get('model')} {load_label(result)} "
    lines = [f"{title:=^78}"]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<42}{fmt(value)}")

    row("endpoint", f"{cfg.get('endpoint')} @ {cfg.get('base_url')}")
    row(
        "dataset",
        f"{dataset.get('name')} in={dataset.get('input_len')} "
        f"out={dataset.get('output_len') or 'default'} "
        f"(tokenizer {cfg.get('tokenizer')})",
    )
    row("completed / failed / cancelled", f"{s.get('completed')} / {s.get('failed')} / {s.get('cancelled')}")
    row("duration (s)", s.get("duration_s"))
    row("request throughput (req/s)", s.get("request_throughput"))
    row("output token throughput (tok/s)", s.get("output_throughput"))
    row("total token throughput (tok/s)", s.get("total_throughput"))
    if s.get("goodput") is not None:
        row(f"goodput ({s.get('slo')}) (req/s)", s.get("goodput"))
    row("mean requests in flight", s.get("concurrency"))
    row("prompt / output tokens", f"{s.get('total_prompt_tokens')} / {s.get('total_output_tokens')}")
    lines.append(f"{'latency (ms)':<18}" + "".join(f"{c:>12}" for c in COLUMNS))
    for name, key in LATENCIES:
        lines.append(f"{name:<18}" + "".join(f"{fmt(s.get(f'{key}.{c}')):>12}" for c in COLUMNS))
    errors = s.get("errors") or {}
    assert isinstance(errors, dict)
    if errors:
        row("errors", ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())))
    for note in _notes(result):
        lines.append(f"note: {note}")
    lines.append("=" * 78)
    return "\n".join(lines)


def format_sweep(results: Sequence[Result]) -> str:
    """One row per load level: throughput against the latencies that matter."""
    head = (
        "load",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "E2E p50",
        "ok",
        "failed",
    )
    keys = (
        "request_throughput",
        "output_throughput",
        "ttft_ms.p50",
        "ttft_ms.p99",
        "itl_ms.p50",
        "itl_ms.p99",
        "tpot_ms.p50",
        "e2e_ms.p50",
        "completed",
        "failed",
    )
    lines = [f"{head[0]:<18}" + "".join(f"{h:>11}" for h in head[1:])]
    for r in results:
        s = _summary(r)
        lines.append(f"{load_label(r):<18}" + "".join(f"{fmt(s.get(k)):>11}" for k in keys))
    return "\n".join(lines)


def format_compare(a: Sequence[Result], b: Sequence[Result], name_a: str, name_b: str) -> str:
    """Side by side, with b/a, for each load level present in both (matched by its label; two
    single runs are compared whatever their load)."""
    if len(a) == 1 and len(b) == 1:
        pairs = [(a[0], b[0])]
    else:
        by_level = {load_label(r): r for r in b}
        pairs = [(r, by_level[load_label(r)]) for r in a if load_label(r) in by_level]
    if not pairs:
        return "no load level in common: nothing to compare"
    width = max(len(name_a), len(name_b), 12) + 2
    out: list[str] = []
    for ra, rb in pairs:
        level = load_label(ra) if load_label(ra) == load_label(rb) else f"{load_label(ra)} vs {load_label(rb)}"
        out.append(f"{' ' + level + ' ':=^{30 + 2 * width + 10}}")
        out.append(f"{'metric':<30}{name_a:>{width}}{name_b:>{width}}{'b/a':>10}  b is")
        sa, sb = _summary(ra), _summary(rb)
        for title, key, higher_is_better in COMPARED:
            va, vb = sa.get(key), sb.get(key)
            ratio, verdict = "-", ""
            if isinstance(va, int | float) and isinstance(vb, int | float) and va:
                ratio = f"{vb / va:.2f}x"
                if vb != va:
                    verdict = "better" if (vb > va) == higher_is_better else "worse"
            out.append(f"{title:<30}{fmt(va):>{width}}{fmt(vb):>{width}}{ratio:>10}  {verdict}")
    return "\n".join(out)


def _config(result: Result) -> dict[str, object]:
    cfg = result.get("config")
    assert isinstance(cfg, dict), "a result has a `config` object"
    return cfg


def _summary(result: Result) -> dict[str, object]:
    s = result.get("summary")
    assert isinstance(s, dict), "a result has a `summary` object"
    return s


def _notes(result: Result) -> list[str]:
    notes = _config(result).get("notes") or []
    assert isinstance(notes, list)
    return [str(n) for n in notes]
