"""`python -m bench agent-replay --sessions N`: many coding agents sharing one server. N conversations,
each with its own system prompt, take turns round-robin (session 0 turn 1, session 1 turn 1, ...,
session 0 turn 2, ...); every turn resends that session's whole history. With a device KV cache that
holds fewer than N histories, each history has been evicted by the time its session's next turn
comes: only a host tier (`--kv-offloading-size`) keeps it.

With `--model` it starts fp4serve twice with the same `--serve-args`: "host" (the tier on, of
`--offload-size` GiB) and "device" (prefix caching on the device only), and sends every request to
both, one after the other. The summary: the cached share of turns 2+, their mean TTFT, and the mean
TTFT of the cold first turns (which pay for the spills)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path
from statistics import mean

import httpx

from bench.agent_replay import Sample, _served_name, send, start_servers, words
from bench.server_process import load_snapshot


def replay_sessions(
    targets: dict[str, str],
    model: str,
    sessions: int,
    system_len: int,
    turns: int,
    turn_len: int,
    output_len: int,
    seed: int,
) -> dict[str, list[Sample]]:
    """Every request to every target in turn; each history follows the first target's answers."""
    rng = random.Random(seed)
    histories = [
        [{"role": "system", "content": words(system_len, rng)}, {"role": "user", "content": words(turn_len, rng)}]
        for _ in range(sessions)
    ]
    out: dict[str, list[Sample]] = {name: [] for name in targets}
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        for turn in range(turns):
            for session, messages in enumerate(histories):
                samples = {
                    name: send(client, url, model, messages, output_len, "turn", turn) for name, url in targets.items()
                }
                for name, sample in samples.items():
                    out[name].append(Sample(**{**asdict(sample), "session": session}))
                answer = next(iter(samples.values())).answer
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "tool" if turn % 2 else "user", "content": words(turn_len, rng)},
                ]
    return out


def session_summary(samples: list[Sample]) -> dict[str, float]:
    """One server's: cached share and mean TTFT of turns 2+, mean TTFT of the first turns."""
    later = [s for s in samples if s.index > 0]
    first = [s for s in samples if s.index == 0]
    return {
        "cached_share_later": sum(s.cached_tokens for s in later) / max(1, sum(s.prompt_tokens for s in later)),
        "mean_ttft_later_s": mean(s.ttft_s for s in later) if later else float("nan"),
        "mean_ttft_first_s": mean(s.ttft_s for s in first) if first else float("nan"),
    }


def table(results: dict[str, list[Sample]]) -> str:
    names = list(results)
    lines = [
        f"{'session':>8}{'turn':>6}{'prompt':>8}" + "".join(f"{n + ' cached':>16}{n + ' TTFT ms':>16}" for n in names)
    ]
    for row in zip(*results.values()):
        line = f"{row[0].session + 1:>8}{row[0].index + 1:>6}{row[0].prompt_tokens:>8}"
        for s in row:
            share = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
            line += f"{f'{s.cached_tokens} ({share:.0%})':>16}{s.ttft_s * 1000:>16.1f}"
        lines.append(line)
    return "\n".join(lines)


def cmd_sessions(args: argparse.Namespace, before: dict[str, float]) -> int:
    scenario = dict(
        sessions=args.sessions,
        system_len=args.system_len,
        turns=args.turns,
        turn_len=args.turn_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    if args.base_url:
        base = args.base_url.rstrip("/")
        results = replay_sessions({"server": base}, _served_name(base, args.served_model), **scenario)
    else:
        variants = (("host", ["--kv-offloading-size", str(args.offload_size)]), ("device", []))
        with start_servers(args, variants) as urls:
            results = replay_sessions(urls, _served_name(urls["host"], args.served_model), **scenario)
    print(table(results))
    totals = {name: session_summary(samples) for name, samples in results.items()}
    if "host" in totals and "device" in totals:
        host, device = totals["host"], totals["device"]
        totals["ratios"] = {
            "ttft_later_device_over_host": device["mean_ttft_later_s"] / host["mean_ttft_later_s"],
            "ttft_first_host_over_device": host["mean_ttft_first_s"] / device["mean_ttft_first_s"],
        }
    for name, values in totals.items():
        print(name + ": " + "  ".join(f"{k} {v:.3g}" for k, v in values.items()))
    document = {
        "scenario": scenario,
        "serve_args": getattr(args, "serve_args", None),
        "offload_size_gib": args.offload_size,
        "load_before": before,
        "load_after": load_snapshot(),
        "summary": totals,
        "samples": {name: [asdict(s) for s in samples] for name, samples in results.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1))
    return 0
