"""`bench peers`' table: one row per (server, streams) from `bench serve` results, with the
count of answers that reached the asked length, as markdown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.report import Result


def full_length(result: Result, output_len: int) -> tuple[int, int]:
    """(requests that made exactly `output_len` tokens, successful requests)."""
    ok = [r for r in result.get("requests") or [] if isinstance(r, dict) and not r.get("error")]
    return sum(1 for r in ok if r.get("output_tokens") == output_len), len(ok)


def row(server: str, version: str, result: Result, output_len: int) -> dict[str, object]:
    summary = result.get("summary")
    cfg = result.get("config")
    s = summary if isinstance(summary, dict) else {}
    load = cfg.get("load") if isinstance(cfg, dict) else None
    full, ok = full_length(result, output_len)
    asked = load.get("num_requests") if isinstance(load, dict) else None
    return {"server": server, "version": version,
            "streams": load.get("concurrency") if isinstance(load, dict) else None,
            "output_throughput": s.get("output_throughput"), "ttft_p50_ms": s.get("ttft_ms.p50"),
            "tpot_p50_ms": s.get("tpot_ms.p50"), "itl_p50_ms": s.get("itl_ms.p50"),
            "completed": s.get("completed"), "asked": asked, "failed": s.get("failed"),
            "full_length": full, "ok": ok}


def _f(value: object, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "–"


def format_table(rows: Sequence[Mapping[str, object]], output_len: int) -> str:
    """Markdown: one line per (server, streams)."""
    lines = ["| server | version | streams | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | "
             "ITL p50 (ms) | requests done | full length |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        done = f"{r.get('completed', 0)}/{r['asked']}" if r.get("asked") else str(r.get("completed"))
        full = f"{r.get('full_length')}/{r.get('ok')} at {output_len}"
        lines.append(f"| {r['server']} | {r['version']} | {r.get('streams', '–')} | "
                     f"{_f(r.get('output_throughput'))} | {_f(r.get('ttft_p50_ms'))} | "
                     f"{_f(r.get('tpot_p50_ms'))} | {_f(r.get('itl_p50_ms'))} | {done} | {full} |")
    return "\n".join(lines)


def rows_of(servers: Sequence[Mapping[str, object]], output_len: int) -> list[dict[str, object]]:
    rows = []
    for s in servers:
        for level in s.get("levels") or []:  # type: ignore[union-attr]
            if isinstance(level, dict) and isinstance(level.get("result"), dict):
                rows.append(row(str(s["server"]), str(s["version"]), level["result"], output_len))
    return rows


def load_text(server: Mapping[str, object], key: str) -> str:
    """The 1-minute load average of a server record's snapshot `key`."""
    snap = server.get(key)
    return f"{snap['load1']:.2f}" if isinstance(snap, dict) else "?"
