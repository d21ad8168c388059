"""`bench peers`' tables: one row per (server, round, streams) from `bench serve` results, with the
count of answers that reached the asked length; and the summary, the best configuration of each
peer per round and stream count with fp4serve's ratio to the best other peer, as markdown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.report import Result


def full_length(result: Result, output_len: int) -> tuple[int, int]:
    """(requests that made exactly `output_len` tokens, successful requests)."""
    ok = [r for r in result.get("requests") or [] if isinstance(r, dict) and not r.get("error")]
    return sum(1 for r in ok if r.get("output_tokens") == output_len), len(ok)


def row(
    server: str, version: str, result: Result, output_len: int, peer: str | None = None, round_no: int = 1
) -> dict[str, object]:
    summary = result.get("summary")
    cfg = result.get("config")
    s = summary if isinstance(summary, dict) else {}
    load = cfg.get("load") if isinstance(cfg, dict) else None
    full, ok = full_length(result, output_len)
    asked = load.get("num_requests") if isinstance(load, dict) else None
    return {
        "server": server,
        "peer": peer or server,
        "round": round_no,
        "version": version,
        "streams": load.get("concurrency") if isinstance(load, dict) else None,
        "output_throughput": s.get("output_throughput"),
        "ttft_p50_ms": s.get("ttft_ms.p50"),
        "tpot_p50_ms": s.get("tpot_ms.p50"),
        "itl_p50_ms": s.get("itl_ms.p50"),
        "completed": s.get("completed"),
        "asked": asked,
        "failed": s.get("failed"),
        "full_length": full,
        "ok": ok,
    }


def _f(value: object, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "–"


def format_table(rows: Sequence[Mapping[str, object]], output_len: int) -> str:
    """Markdown: one line per (server, streams)."""
    lines = [
        "| server | round | version | streams | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | "
        "ITL p50 (ms) | requests done | full length |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        done = f"{r.get('completed', 0)}/{r['asked']}" if r.get("asked") else str(r.get("completed"))
        full = f"{r.get('full_length')}/{r.get('ok')} at {output_len}"
        lines.append(
            f"| {r['server']} | {r.get('round', 1)} | {r['version']} | {r.get('streams', '–')} | "
            f"{_f(r.get('output_throughput'))} | {_f(r.get('ttft_p50_ms'))} | "
            f"{_f(r.get('tpot_p50_ms'))} | {_f(r.get('itl_p50_ms'))} | {done} | {full} |"
        )
    return "\n".join(lines)


def rows_of(servers: Sequence[Mapping[str, object]], output_len: int) -> list[dict[str, object]]:
    rows = []
    for s in servers:
        for level in s.get("levels") or []:  # type: ignore[union-attr]
            if isinstance(level, dict) and isinstance(level.get("result"), dict):
                rows.append(
                    row(
                        str(s["server"]),
                        str(s["version"]),
                        level["result"],
                        output_len,
                        str(s.get("peer") or s["server"]),
                        int(s.get("round") or 1),
                    )
                )  # type: ignore[call-overload]
    return rows


def load_text(server: Mapping[str, object], key: str) -> str:
    """The 1-minute load average of a server record's snapshot `key`."""
    snap = server.get(key)
    return f"{snap['load1']:.2f}" if isinstance(snap, dict) else "?"


SELF = "fp4serve"


def summarize(servers: Sequence[Mapping[str, object]], rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Per (round, streams): each peer's best configuration (output tok/s, only requests that all
    finished count) and fp4serve's ratio to the best other peer."""
    del servers  # the rows carry the peer and round of each server
    out: list[dict[str, object]] = []
    keys = sorted({(int(r.get("round") or 1), int(r["streams"])) for r in rows if isinstance(r.get("streams"), int)})
    for round_no, streams in keys:
        best: dict[str, tuple[float, str]] = {}
        for r in rows:
            tput = r.get("output_throughput")
            complete = r.get("asked") is None or r.get("completed") == r.get("asked")
            if (
                (int(r.get("round") or 1), r.get("streams")) != (round_no, streams)
                or not isinstance(tput, int | float)
                or not complete
            ):
                continue
            peer = str(r.get("peer") or r["server"])
            if peer not in best or tput > best[peer][0]:
                best[peer] = (float(tput), str(r["server"]))
        others = [v for k, v in best.items() if k != SELF]
        top = max(others, default=None)
        ratio = best[SELF][0] / top[0] if SELF in best and top is not None and top[0] > 0 else None
        out.append(
            {
                "round": round_no,
                "streams": streams,
                "best": {k: {"output_throughput": v[0], "server": v[1]} for k, v in best.items()},
                "best_other": None if top is None else {"server": top[1], "output_throughput": top[0]},
                "fp4serve_ratio": ratio,
            }
        )
    return out


def format_summary(summary: Sequence[Mapping[str, object]]) -> str:
    """Markdown: per round and stream count, each peer's best (and which configuration), and
    fp4serve against the best other peer."""
    peers = list(dict.fromkeys(p for s in summary for p in s["best"]))  # type: ignore[union-attr]
    lines = [
        "| round | streams | " + " | ".join(peers) + " | fp4serve / best other |",
        "|---:|---:|" + "---:|" * len(peers) + "---:|",
    ]
    for s in summary:
        best = s["best"]
        cells = []
        for p in peers:
            b = best.get(p) if isinstance(best, dict) else None
            cells.append(
                f"{b['output_throughput']:.1f} ({b['server']})"
                if b and b["server"] != p
                else (f"{b['output_throughput']:.1f}" if b else "–")
            )
        ratio = s.get("fp4serve_ratio")
        lines.append(
            f"| {s['round']} | {s['streams']} | "
            + " | ".join(cells)
            + " | "
            + (f"{ratio:.2f}x" if isinstance(ratio, float) else "–")
            + " |"
        )
    return "\n".join(lines)
