"""PNG charts of bench results, one line per result file: latency against output throughput
across a load sweep, throughput against load, and the TTFT and ITL distributions (CDFs)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# The object API with the Agg canvas: no pyplot, so no global figure state and no display.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.report import Result, load_label

Run = tuple[str, Sequence[Result]]  # (label, the results of one file, in load order)


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _summary_value(result: Result, key: str) -> float | None:
    summary = result.get("summary")
    return _num(summary.get(key)) if isinstance(summary, dict) else None


def _load_value(result: Result) -> float | None:
    """The sweep's x: concurrency, else request rate."""
    cfg = result.get("config")
    load = cfg.get("load") if isinstance(cfg, dict) else None
    if not isinstance(load, dict):
        return None
    return _num(load.get("concurrency")) or _num(load.get("request_rate"))


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_latency_vs_throughput(runs: Sequence[Run], path: Path) -> Path:
    fig = Figure(figsize=(12, 4.8))
    for ax, (name, key) in zip(fig.subplots(1, 2), (("TTFT", "ttft_ms"), ("ITL", "itl_ms"))):
        for i, (label, results) in enumerate(runs):
            color = f"C{i % 10}"
            for pct, style in (("p50", "-"), ("p99", "--")):
                pts = [
                    (x, y, load_label(r))
                    for r in results
                    if (x := _summary_value(r, "output_throughput")) is not None
                    and (y := _summary_value(r, f"{key}.{pct}")) is not None
                ]
                if not pts:
                    continue
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color, label=f"{label} {pct}"
                )
                if pct == "p50":
                    for x, y, text in pts:
                        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 (solid) and p99 (dashed) vs throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput_vs_load(runs: Sequence[Run], path: Path) -> Path:
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.subplots()
    levels: set[float] = set()
    for i, (label, results) in enumerate(runs):
        pts = sorted(
            (x, y)
            for r in results
            if (x := _load_value(r)) is not None and (y := _summary_value(r, "output_throughput")) is not None
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i % 10}", label=label)
            levels.update(p[0] for p in pts)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(levels), [f"{x:g}" for x in sorted(levels)])
    ax.minorticks_off()
    ax.set_xlabel("load (concurrency, or request rate /s)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _request_values(result: Result, key: str) -> list[float]:
    """Per-request values of `key` (a number or a list, e.g. `itl_ms`) of successful requests."""
    values: list[float] = []
    for req in result.get("requests") or []:
        if not isinstance(req, dict) or req.get("error"):
            continue
        v = req.get(key)
        values.extend(v if isinstance(v, list) else [] if v is None else [v])
    return sorted(values)


def plot_latency_cdfs(runs: Sequence[Run], path: Path) -> Path:
    fig = Figure(figsize=(12, 4.8))
    for ax, (name, key) in zip(fig.subplots(1, 2), (("TTFT", "ttft_ms"), ("ITL", "itl_ms"))):
        lo, hi = float("inf"), 0.0
        for i, (label, results) in enumerate(runs):
            for j, r in enumerate(results):
                values = _request_values(r, key)
                if not values:
                    continue
                lo, hi = min(lo, values[0]), max(hi, values[-1])
                ys = [(k + 1) / len(values) for k in range(len(values))]
                # Levels of one file share its colour, lighter for lighter load.
                alpha = 0.35 + 0.65 * (j + 1) / len(results)
                ax.step(values, ys, where="post", color=f"C{i % 10}", alpha=alpha, label=f"{label} {load_label(r)}")
        if lo > 0 and hi / lo > 20:  # a log axis only where the spread needs one
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key == "ttft_ms" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_results(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Draw every chart into `out_dir` (created); returns the PNG paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_vs_throughput(runs, out / "latency_vs_throughput.png"),
        plot_throughput_vs_load(runs, out / "throughput_vs_load.png"),
        plot_latency_cdfs(runs, out / "latency_cdf.png"),
    ]


def plot_throughput_bars(rows: Sequence[dict[str, object]], path: str | Path) -> Path:
    """Grouped bars of output throughput: one group per stream count, one bar per server (rows
    as `bench peers` makes them: `server`, `streams`, `output_throughput`)."""
    servers = list(dict.fromkeys(str(r["server"]) for r in rows))
    levels = sorted({int(s) for r in rows if isinstance(s := r.get("streams"), int)})
    fig = Figure(figsize=(max(6.4, 1.6 * len(levels) * len(servers) / 2), 4.8))
    ax = fig.subplots()
    width = 0.8 / max(len(servers), 1)
    for i, server in enumerate(servers):
        xs, ys = [], []
        for j, level in enumerate(levels):
            y = next(
                (_num(r.get("output_throughput")) for r in rows if r["server"] == server and r.get("streams") == level),
                None,
            )
            if y is not None:
                xs.append(j + (i - (len(servers) - 1) / 2) * width)
                ys.append(y)
        bars = ax.bar(xs, ys, width, color=f"C{i % 10}", label=server)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(levels)), [f"{n} stream{'s' if n > 1 else ''}" for n in levels])
    ax.set_ylabel("output throughput (tok/s)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, Path(path))


def plot_soak_timeline(
    samples: Sequence[dict[str, float]], ttfts: Sequence[tuple[float, float]], path: str | Path, title: str = ""
) -> Path:
    """`bench soak --abuse`: resident memory (engine, HTTP) and the grammar cache's bytes against
    time, above the well-behaved clients' TTFTs (seconds since the start, TTFT)."""
    fig = Figure(figsize=(11, 6.4))
    top, bottom = fig.subplots(2, 1, sharex=True)
    t = [s["t"] for s in samples]
    for key, label in (
        ("engine_rss_mib", "engine RSS"),
        ("http_rss_mib", "HTTP RSS"),
        ("grammar_cache_mib", "grammar cache (xgrammar's size)"),
        ("grammar_held_mib", "grammars held by requests past the cache"),
    ):
        ys = [s.get(key) for s in samples]
        if any(y is not None for y in ys):
            top.plot(t, [y if y is not None else float("nan") for y in ys], label=label)
    budget = next((s["grammar_budget_mib"] for s in samples if s.get("grammar_budget_mib")), None)
    if budget:
        top.axhline(budget, color="grey", linestyle=":", label="grammar budget")
    top.set_ylabel("MiB")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    top.set_title(title, fontsize=9)
    bottom.plot([x for x, _ in ttfts], [y * 1000 for _, y in ttfts], ".", markersize=3, label="well-behaved TTFT")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("TTFT (ms)")
    bottom.set_yscale("log")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8)
    return _save(fig, Path(path))
