"""`python -m bench agent-replay`: a coding agent's conversation replayed against OpenAI-compatible
servers — a long system prompt, then turns that each resend the whole history (the previous prompt,
its answer, a new user or tool message) — and users that share the system prompt. Per request: the
prompt tokens, the cached ones (usage.prompt_tokens_details.cached_tokens) and the TTFT (first
streamed token).

With `--model`, the scenario starts fp4serve twice (prefix caching on, and `--no-prefix-caching`)
and sends every request to both, one after the other, so each TTFT ratio is measured back to back;
the "off" server gets the same history (the "on" server's answers). With `--base-url` it replays
against that one server.

`--sessions N`: many agents at once (bench/agent_sessions.py): N conversations, each with its own
system prompt, taking turns round-robin, against a device KV cache meant to hold fewer than N
histories; with `--model` the two servers are the host KV tier on (`--kv-offloading-size`) and off."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.server_process import load_snapshot, running, wait_ready

# The tiny hybrid of `bench tiny-model` has a word-level tokenizer (w0 .. w1022): one token a word.
VOCAB_WORDS = 1000


@dataclass(frozen=True)
class Sample:
    kind: str  # "turn" (the agent's conversation) or "user" (another user of the system prompt)
    index: int  # the turn (from 0), or the user
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    answer: str
    session: int = 0  # --sessions: which conversation


def words(n: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


def send(
    client: httpx.Client,
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    kind: str,
    index: int,
) -> Sample:
    """One streamed chat request: TTFT at the first content, usage from the last chunk."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft, pieces, usage = None, [], {}
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{base_url}: HTTP {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(text)
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        kind,
        index,
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens") or 0,
        ttft if ttft is not None else float("nan"),
        "".join(pieces),
    )


def replay(
    targets: dict[str, str],
    model: str,
    system_len: int,
    turns: int,
    turn_len: int,
    output_len: int,
    users: int,
    seed: int,
) -> dict[str, list[Sample]]:
    """Every request to every target in turn; the history follows the first target's answers."""
    rng = random.Random(seed)
    system = words(system_len, rng)
    out: dict[str, list[Sample]] = {name: [] for name in targets}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": words(turn_len, rng)}]
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        for turn in range(turns):
            samples = {
                name: send(client, url, model, messages, output_len, "turn", turn) for name, url in targets.items()
            }
            for name, sample in samples.items():
                out[name].append(sample)
            first = next(iter(samples.values()))
            messages = messages + [
                {"role": "assistant", "content": first.answer},
                {"role": "tool" if turn % 2 else "user", "content": words(turn_len, rng)},
            ]
        for user in range(users):
            asked = [{"role": "system", "content": system}, {"role": "user", "content": words(turn_len // 4 + 1, rng)}]
            for name, url in targets.items():
                out[name].append(send(client, url, model, asked, output_len, "user", user))
    return out


def table(results: dict[str, list[Sample]]) -> str:
    names = list(results)
    head = f"{'request':<9}{'prompt':>8}" + "".join(f"{n + ' cached':>14}{n + ' TTFT ms':>14}" for n in names)
    if len(names) == 2:
        head += f"{'TTFT ' + names[1] + '/' + names[0]:>16}"
    lines = [head]
    for row in zip(*results.values()):
        line = f"{row[0].kind + ' ' + str(row[0].index + 1):<9}{row[0].prompt_tokens:>8}"
        for s in row:
            share = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
            line += f"{f'{s.cached_tokens} ({share:.0%})':>14}{s.ttft_s * 1000:>14.1f}"
        if len(row) == 2:
            line += f"{row[1].ttft_s / row[0].ttft_s:>15.2f}x"
        lines.append(line)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    where.add_argument(
        "--model",
        help="a checkpoint folder: start fp4serve on it twice, prefix caching on and "
        "off, and send every request to both (bench tiny-model hybrid writes a tiny one)",
    )
    p.add_argument("--served-model", default=None, help="the model name in requests (default: the server's first)")
    p.add_argument(
        "--serve-args",
        default="--dtype float32 --kv-cache-memory 256MiB",
        help="with --model: more fp4serve serve flags for both servers",
    )
    p.add_argument("--system-len", type=int, default=2000, help="system prompt words")
    p.add_argument("--turns", type=int, default=6, help="agent turns (each resends the whole history)")
    p.add_argument("--turn-len", type=int, default=120, help="words of each new user or tool message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--users", type=int, default=3, help="other users sharing the system prompt, after the agent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the samples as JSON here")
    p.add_argument(
        "--sessions",
        type=int,
        default=0,
        metavar="N",
        help="many agents: N conversations (own system prompts), turns round-robin; with --model the "
        "servers are the host KV tier on and off (0: the one agent and its users)",
    )
    p.add_argument(
        "--offload-size",
        default="1",
        metavar="GiB",
        help="with --model and --sessions: --kv-offloading-size of the tier-on server",
    )


def _served_name(base_url: str, given: str | None) -> str:
    if given:
        return given
    return httpx.get(f"{base_url}/v1/models", timeout=30.0, trust_env=False).json()["data"][0]["id"]


def cmd_agent_replay(args: argparse.Namespace) -> int:
    scenario = dict(
        system_len=args.system_len,
        turns=args.turns,
        turn_len=args.turn_len,
        output_len=args.output_len,
        users=args.users,
        seed=args.seed,
    )
    assert not args.sessions, "bench/__main__.py sends --sessions to bench/agent_sessions.py"
    before = load_snapshot()
    if args.base_url:
        base = args.base_url.rstrip("/")
        results = replay({"server": base}, _served_name(base, args.served_model), **scenario)
    else:
        results = _replay_on_and_off(args, scenario)
    print(table(results))
    totals = summary(results)
    print("  ".join(f"{k} {v:.3g}" for k, v in totals.items()))
    document = {
        "scenario": scenario,
        "load_before": before,
        "load_after": load_snapshot(),
        "summary": totals,
        "samples": {name: [asdict(s) for s in samples] for name, samples in results.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1))
    return 0


def _replay_on_and_off(args: argparse.Namespace, scenario: dict[str, int]) -> dict[str, list[Sample]]:
    with start_servers(args, (("on", []), ("off", ["--no-prefix-caching"]))) as urls:
        return replay(urls, _served_name(urls["on"], args.served_model), **scenario)


@contextlib.contextmanager
def start_servers(args: argparse.Namespace, variants: tuple[tuple[str, list[str]], ...]) -> Iterator[dict[str, str]]:
    """fp4serve on `args.model` once per (name, extra flags) with `args.serve_args`: their base URLs by
    name, while the block runs."""
    import socket
    import tempfile

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    extra = args.serve_args.split()
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, flags in variants:
            p = port()
            log = Path(tempfile.mkstemp(prefix=f"agent-replay-{name}-", suffix=".log")[1])
            argv = [
                sys.executable,
                "-m",
                "api.cli",
                "serve",
                "--model",
                args.model,
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
                *extra,
                *flags,
            ]
            proc = stack.enter_context(running(argv, {}, log))
            urls[name] = f"http://127.0.0.1:{p}"
            wait_ready(proc, f"{urls[name]}/health", 600.0, log)
            print(f"{name}: {urls[name]} (log {log})", file=sys.stderr)
        yield urls


def summary(results: dict[str, list[Sample]]) -> dict[str, float]:
    """Cached share of turns 2.. and of the other users' prompts, last turn's TTFT ratio off/on."""
    on = results.get("on") or next(iter(results.values()))
    turns = [s for s in on if s.kind == "turn"]
    users = [s for s in on if s.kind == "user"]
    out = {
        "min_cached_share_later_turns": min((s.cached_tokens / s.prompt_tokens for s in turns[1:]), default=0.0),
        "min_cached_tokens_users": float(min((s.cached_tokens for s in users), default=0)),
    }
    if "off" in results:
        off_turns = [s for s in results["off"] if s.kind == "turn"]
        out["last_turn_ttft_ratio"] = off_turns[-1].ttft_s / turns[-1].ttft_s
    return out
