"""`python -m bench {serve,plot,compare,offline,profile,host-step,soak,context,tiny-model,moe-models,quality,lm-eval,
peers,agent-replay}`: flags to
configs, runs, tables and files."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import orjson
from tqdm import tqdm

from bench.agent_replay import add_arguments as add_agent_replay_arguments
from bench.agent_replay import cmd_agent_replay
from bench.datasets import DATASETS, DatasetSpec, TokenCounter, build_dataset, load_tokenizer
from bench.first_grammar import add_arguments as add_first_grammar_arguments
from bench.lm_eval_run import add_arguments as add_lm_eval_arguments
from bench.lm_eval_run import cmd_lm_eval
from bench.moe_models import add_arguments as add_moe_model_arguments
from bench.moe_models import cmd_moe_models
from bench.noisy_neighbor import add_arguments as add_noisy_neighbor_arguments
from bench.peers import add_arguments as add_peers_arguments
from bench.peers import cmd_peers
from bench.quality import add_arguments as add_quality_arguments
from bench.quality import cmd_quality
from bench.report import (
    Result,
    format_compare,
    format_summary,
    format_sweep,
    load_results,
    result_document,
    write_results,
)
from bench.serve import ENDPOINTS, EndpointError, Load, Target, discover_model, probe_target, run_load
from bench.soak import add_arguments as add_soak_arguments
from bench.soak import cmd_soak
from bench.stats import RequestRecord, Slo, summarize

INTERRUPTED_EXIT = 130


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    return [math.inf if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def _add_dataset_flags(p: argparse.ArgumentParser, input_len: int, num_requests: int) -> None:
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random prompts of --input-len tokens; shared-prefix groups (prefix-cache workload); "
        "multi-turn conversations; jsonl: your own file",
    )
    p.add_argument(
        "--dataset-path",
        help="jsonl: ShareGPT-style conversations or {prompt, max_tokens} lines (a JSON array also works)",
    )
    p.add_argument("--num-requests", type=int, default=num_requests, help="requests per load level (multi-turn: turns)")
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens (per turn)")
    p.add_argument(
        "--output-len", type=int, default=None, help="output tokens (default 128; jsonl: each record's answer length)"
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="draw lengths uniformly from [L(1-r), L(1+r)]")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    p.add_argument(
        "--duration", type=float, default=300.0, help="seconds per load level; requests still in flight are cancelled"
    )
    p.add_argument("--out", help="write results as JSON here")


def _spec(args: argparse.Namespace, seed: int) -> DatasetSpec:
    return DatasetSpec(
        args.dataset,
        args.num_requests,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.prefix_len,
        args.num_groups,
        args.num_turns,
        args.dataset_path,
        seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint over HTTP")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's OpenAI base URL")
    s.add_argument("--model", help="default: the first of GET /models")
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--endpoint", choices=ENDPOINTS, default="chat", help="/v1/chat/completions or /v1/completions")
    s.add_argument("--label", help="name of this run in tables and charts")
    load = s.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=_ints, help="closed loop: clients in flight; a list (1,4,16) sweeps (default 8)"
    )
    load.add_argument(
        "--request-rate", type=_rates, help="open loop: Poisson arrivals per second; a list sweeps; inf: all at 0"
    )
    s.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    s.add_argument("--tokenizer", help="folder with tokenizer.json (or the file) of the model")
    s.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos/min_tokens (servers that reject them)"
    )
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    s.add_argument(
        "--extra-body", type=orjson.loads, default={}, help="JSON merged into every request, e.g. '{\"top_k\": 20}'"
    )
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    s.add_argument("--slo", type=Slo.parse, help="goodput objectives: ttft=MS,tpot=MS,e2e=MS")
    s.add_argument("--no-progress", action="store_true", help="no live progress bar (for logs)")
    _add_dataset_flags(s, input_len=1024, num_requests=200)
    s.add_argument(
        "--scenario",
        choices=("load", "noisy-neighbor", "first-grammar"),
        default="load",
        help="load: the dataset at the chosen load levels; noisy-neighbor: one key floods, another "
        "sends short requests, each key's TTFT percentiles (bench/noisy_neighbor.py); first-grammar: "
        "a plain stream's largest inter-token gap while the server's first constrained request "
        "arrives, against its gap alone (bench/first_grammar.py)",
    )
    add_noisy_neighbor_arguments(s)
    add_first_grammar_arguments(s)

    p = sub.add_parser("plot", help="draw PNG charts from result files")
    p.add_argument("results", nargs="+", help="result files of `bench serve --out` (one line per file)")
    p.add_argument("--out", default="bench-plots", help="folder for the PNGs")

    c = sub.add_parser("compare", help="side-by-side table of two result files, with b/a")
    c.add_argument("a", help="the baseline result file")
    c.add_argument("b", help="the result file compared with it (ratios are b/a)")

    o = sub.add_parser("offline", help="drive the engine in-process (no HTTP)")
    o.add_argument("--model", help="checkpoint folder (default: the embedded demo model)")
    o.add_argument("--dtype", default="auto", help="as fp4serve serve --dtype")
    o.add_argument("--device", default="auto", help="as fp4serve serve --device")
    o.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "nvfp4", "int8"),
        help="as fp4serve serve --quantization (default auto, as the server)",
    )
    o.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one running batch")
    o.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (default: the engine's)")
    o.add_argument("--max-model-len", type=int, help="context length (default: the checkpoint's)")
    o.add_argument("--kv-cache-memory", help='KV cache size: bytes ("2GiB") or a fraction')
    o.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every request")
    _add_dataset_flags(o, input_len=256, num_requests=64)

    x = sub.add_parser(
        "context",
        help="decode step time as the context grows, per model (e.g. a hybrid against a dense model of the same width)",
    )
    x.add_argument("models", nargs="+", help="checkpoint folders (bench tiny-model writes test ones)")
    x.add_argument("--batch-size", type=int, default=4, help="sequences decoding together")
    x.add_argument("--context", type=int, default=2048, help="tokens per sequence at the end")
    x.add_argument("--window", type=int, default=256, help="decode steps averaged into one point")
    x.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size of each engine")
    x.add_argument("--out", help="write the curves as JSON here")

    t = sub.add_parser("tiny-model", help="write a random-weight dense or hybrid checkpoint (for bench context)")
    t.add_argument(
        "kind", choices=("dense", "hybrid"), help="Qwen3 dense, or Qwen3.5 hybrid (3 DeltaNet : 1 attention)"
    )
    t.add_argument("dst", help="folder to write")
    t.add_argument("--hidden-size", type=int, default=256, help="model width")
    t.add_argument("--num-layers", type=int, default=8, help="decoder layers")
    pe = sub.add_parser(
        "peers",
        help="fp4serve against peer servers (llama.cpp, vLLM CPU, transformers) "
        "on the same model, started one at a time, at 1 and 32 streams",
    )
    add_peers_arguments(pe)
    m = sub.add_parser(
        "moe-models",
        help="write a random Qwen3-MoE checkpoint and its every-expert-active twin, for `offline` to compare",
    )
    add_moe_model_arguments(m)

    f = sub.add_parser(
        "profile",
        help="where a decode step's time goes (matmuls, attention, norms, RoPE, "
        "sampling, Python) at given batch sizes, in-process",
    )
    f.add_argument("--model", help="checkpoint folder or built-in model name (default: the server's default model)")
    f.add_argument("--dtype", default="auto", help="as fp4serve serve --dtype")
    f.add_argument("--quantization", default="auto", help="as fp4serve serve --quantization")
    f.add_argument("--kv-cache-dtype", default="auto", help="as fp4serve serve --kv-cache-dtype")
    f.add_argument("--batch-size", type=_ints, default=[1, 32], help="decode batch sizes, e.g. 1,32")
    f.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    f.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size (and per mode)")
    f.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    f.add_argument("--max-model-len", type=int, default=2048, help="context length of the engine")
    f.add_argument("--kv-cache-memory", default="512MiB", help='KV cache size ("512MiB")')
    f.add_argument(
        "--op-table",
        action="store_true",
        help="also print torch.profiler's table of the top aten ops (its overhead inflates "
        "small ops; read it for counts and the big kernels)",
    )
    f.add_argument("--out", help="write results as JSON here")

    h = sub.add_parser(
        "host-step",
        help="the host's time per decode step with a forward that costs nothing "
        "(real scheduler, batch, sampler, update, detokenizer), and what of it a "
        "simulated forward hides, async scheduling on and off",
    )
    h.add_argument("--batch-size", type=_ints, default=[1, 16, 64, 256], help="decode batch sizes, e.g. 1,16,64,256")
    h.add_argument(
        "--forward-ms",
        type=_rates,
        default=[0.0, 5.0],
        help="simulated device time of each forward, e.g. 0,5 (0: every host millisecond shows)",
    )
    h.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size, forward time and mode")
    h.add_argument("--warmup", type=int, default=10, help="decode steps run before the timed ones")
    h.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    h.add_argument(
        "--hidden-size",
        type=int,
        default=64,
        help="width of the tiny model written for the run (its weights are never used: the forward is a stub)",
    )
    h.add_argument(
        "--model", help="a checkpoint folder instead of the tiny model (its vocabulary sets the sampler's work)"
    )
    h.add_argument("--out", help="write results as JSON here")

    k = sub.add_parser(
        "soak",
        help="mixed valid, invalid and disconnecting clients for a while; then "
        "check nothing leaked (exit 1 if anything did)",
    )
    add_soak_arguments(k)

    q = sub.add_parser(
        "quality",
        help="a served model's perplexity on real text (echo + prompt logprobs), "
        "and top-1 agreement with a reference run",
    )
    add_quality_arguments(q)
    e = sub.add_parser(
        "lm-eval",
        help="lm-eval's local-completions loglikelihood run on a local task against a "
        "server it starts, checked against transformers",
    )
    add_lm_eval_arguments(e)
    a = sub.add_parser(
        "agent-replay",
        help="a coding agent's multi-turn conversation with a long system prompt, "
        "and users sharing it: cached share and TTFT per request, prefix caching on and off",
    )
    add_agent_replay_arguments(a)
    return parser


def _config(
    args: argparse.Namespace, target: Target, load: Load, spec: DatasetSpec, tokenizer: TokenCounter, notes: list[str]
) -> dict[str, object]:
    load_dict = dataclasses.asdict(load)
    if load.request_rate is not None and math.isinf(load.request_rate):
        load_dict["request_rate"] = "inf"  # JSON has no infinity
    # A peer may serve under its checkpoint's path: keep only the folder name in the results file.
    model = (
        target.model.rstrip("/").rsplit("/", 1)[-1] if target.model and target.model.startswith("/") else target.model
    )
    return {
        "label": args.label,
        "base_url": target.base_url,
        "model": model,
        "endpoint": target.endpoint,
        "load_label": load.label,
        "load": load_dict,
        "dataset": dataclasses.asdict(spec),
        "tokenizer": tokenizer.name,
        "tokenizer_exact": tokenizer.exact,
        "ignore_eos": target.ignore_eos,
        "temperature": target.temperature,
        "extra_body": target.extra_body,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "notes": list(notes),
    }


async def _serve_levels(
    args: argparse.Namespace, target: Target, loads: Sequence[Load], tokenizer: TokenCounter, notes: list[str]
) -> tuple[list[Result], bool]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print("\ninterrupted: finishing with what was measured (Ctrl-C again to quit)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C ends the process

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    target, note = await probe_target(target)
    if note:
        notes.append(note)
    results: list[Result] = []
    for i, load in enumerate(loads):
        # NOTE: a fresh seed per level, so no level reuses another's prompts from the prefix
        # cache (reruns inflate throughput); jsonl prompts only change order.
        spec = _spec(args, args.seed + i)
        conversations = build_dataset(spec, tokenizer)
        bar = tqdm(
            total=load.num_requests,
            desc=load.label,
            unit="req",
            file=sys.stderr,
            disable=args.no_progress,
            dynamic_ncols=True,
        )
        failed = 0

        def on_record(r: RequestRecord, bar: tqdm = bar) -> None:
            nonlocal failed
            failed += not r.ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed, refresh=False)

        run = await run_load(target, load, conversations, on_record=on_record, stop=stop)
        bar.close()
        config = _config(args, target, load, spec, tokenizer, notes)
        config.update(interrupted=run.interrupted, timed_out=run.timed_out)
        if run.timed_out:
            config["notes"] = [*notes, f"stopped by --duration {load.duration_s:g}s"]
        if run.interrupted:
            config["notes"] = [*notes, "interrupted (Ctrl-C): figures cover what ran"]
        result = result_document(config, summarize(run.records, run.duration_s, args.slo), run.records)
        results.append(result)
        print(format_summary(result), flush=True)
        if run.interrupted:
            return results, True
    return results, False


def cmd_noisy_neighbor(args: argparse.Namespace, model: str) -> int:
    from bench.noisy_neighbor import format_result, run, scenario_from_args

    result = asyncio.run(run(scenario_from_args(args, model)))
    print(format_result(result))
    if args.out:
        Path(args.out).write_bytes(
            orjson.dumps({"scenario": "noisy-neighbor", "label": args.label, **result}, option=orjson.OPT_INDENT_2)
        )
    return 0


def cmd_first_grammar(args: argparse.Namespace, model: str) -> int:
    from bench.first_grammar import format_result, run, scenario_from_args

    result = asyncio.run(run(scenario_from_args(args, model)))
    print(format_result(result))
    if args.out:
        Path(args.out).write_bytes(
            orjson.dumps({"scenario": "first-grammar", "label": args.label, **result}, option=orjson.OPT_INDENT_2)
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    notes: list[str] = []
    try:
        model = args.model or discover_model(args.base_url, args.api_key)
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.scenario == "noisy-neighbor":
        return cmd_noisy_neighbor(args, model)
    if args.scenario == "first-grammar":
        return cmd_first_grammar(args, model)
    tokenizer = load_tokenizer(args.tokenizer, args.base_url, model, args.api_key)
    if not tokenizer.exact:
        notes.append(
            "no tokenizer (--tokenizer, a local model folder, or the server's "
            "/tokenize): prompt lengths are approximate, one token per word"
        )
        print(f"warning: {notes[-1]}", file=sys.stderr)
    target = Target(
        args.base_url,
        model,
        args.endpoint,
        args.api_key,
        not args.no_ignore_eos,
        args.temperature,
        args.extra_body,
        args.request_timeout,
    )
    common = dict(num_requests=args.num_requests, duration_s=args.duration, seed=args.seed)
    if args.request_rate:
        loads = [
            Load(request_rate=r, max_concurrency=args.max_concurrency, burstiness=args.burstiness, **common)
            for r in args.request_rate
        ]
    else:
        loads = [Load(concurrency=c, **common) for c in (args.concurrency or [8])]
    try:
        results, interrupted = asyncio.run(_serve_levels(args, target, loads, tokenizer, notes))
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print(format_sweep(results))
    if args.out and results:
        write_results(args.out, results)
        print(f"wrote {args.out}", file=sys.stderr)
    return INTERRUPTED_EXIT if interrupted else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from bench.plot import plot_results  # matplotlib only when charts are asked for

    runs = [(_label(path, results), results) for path in args.results for results in [load_results(path)]]
    for path in plot_results(runs, args.out):
        print(path)
    return 0


def _label(path: str, results: list[Result]) -> str:
    cfg = results[0].get("config")
    label = cfg.get("label") if isinstance(cfg, dict) else None
    return str(label) if label else Path(path).stem


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = load_results(args.a), load_results(args.b)
    print(format_compare(a, b, _label(args.a, a), _label(args.b, b)))
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    from bench.offline import EngineTokenCounter, format_offline, run_offline
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine
    from scheduler.request import SamplingParams

    fields: dict[str, object] = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        quantization=args.quantization,
    )
    for name in ("max_num_batched_tokens", "max_model_len", "kv_cache_memory"):
        if getattr(args, name) is not None:  # else EngineConfig's default
            fields[name] = getattr(args, name)
    engine = OfflineEngine.from_config(EngineConfig(**fields))
    counter = EngineTokenCounter(engine)
    conversations = build_dataset(_spec(args, args.seed), counter)
    # Warm up outside the measured window: first-call allocations and lazy init.
    engine.generate([counter.encode("warm up")], SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True))
    bar = tqdm(total=args.num_requests, desc="offline", unit="req", file=sys.stderr)
    report = run_offline(
        engine,
        conversations,
        counter.encode,
        num_requests=args.num_requests,
        duration_s=args.duration,
        temperature=args.temperature,
        on_finish=lambda: bar.update(1),
    )
    bar.close()
    title = f"offline: {args.model or 'demo'} {args.dataset} in={args.input_len} max_num_seqs={args.max_num_seqs}"
    print(format_offline(report, title))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.out).write_bytes(
            orjson.dumps({"config": config, "summary": report.to_dict()}, option=orjson.OPT_INDENT_2)
        )
    return INTERRUPTED_EXIT if report.interrupted else 0


def cmd_context(args: argparse.Namespace) -> int:
    from bench.context_curve import curves_for, format_curves

    curves = curves_for(args.models, args.batch_size, args.context, args.window, args.kv_cache_memory)
    print(format_curves(curves))
    if args.out:
        data = {name: [dataclasses.asdict(p) for p in points] for name, points in curves.items()}
        Path(args.out).write_bytes(
            orjson.dumps(
                {"config": {k: v for k, v in vars(args).items() if k != "func"}, "curves": data},
                option=orjson.OPT_INDENT_2,
            )
        )
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from bench.context_curve import write_tiny_model

    print(write_tiny_model(Path(args.dst), args.kind, args.hidden_size, args.num_layers))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from bench.profile import format_profile, profile_decode
    from engine.config import EngineConfig
    from engine.front.offline import OfflineEngine

    engine = OfflineEngine.from_config(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=max(args.batch_size),
            max_model_len=args.max_model_len,
            kv_cache_memory=args.kv_cache_memory,
        )
    )
    profiles = []
    for batch_size in args.batch_size:
        prof, table = profile_decode(
            engine, batch_size, args.input_len, args.steps, args.temperature, op_table=args.op_table
        )
        profiles.append(prof)
        if table is not None:
            print(f"torch.profiler, batch {batch_size}:\n{table}")
    print(format_profile(profiles, f"decode step: {args.model or 'demo'}, in={args.input_len}"))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.out).write_bytes(
            orjson.dumps({"config": config, "profiles": [p.to_dict() for p in profiles]}, option=orjson.OPT_INDENT_2)
        )
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    """agent-replay: one agent and its users, or with --sessions many agents taking turns."""
    if args.sessions:
        from bench.agent_sessions import cmd_sessions
        from bench.server_process import load_snapshot

        return cmd_sessions(args, load_snapshot())
    return cmd_agent_replay(args)


def cmd_host_step(args: argparse.Namespace) -> int:
    from bench.host_step import format_host_step, host_step_document, run_host_step

    results = run_host_step(
        args.batch_size, args.forward_ms, args.steps, args.warmup, args.input_len, args.hidden_size, args.model
    )
    print(format_host_step(results))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.out).write_bytes(orjson.dumps(host_step_document(results, config), option=orjson.OPT_INDENT_2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "serve": cmd_serve,
        "plot": cmd_plot,
        "compare": cmd_compare,
        "offline": cmd_offline,
        "soak": cmd_soak,
        "context": cmd_context,
        "tiny-model": cmd_tiny_model,
        "moe-models": cmd_moe_models,
        "peers": cmd_peers,
        "profile": cmd_profile,
        "host-step": cmd_host_step,
        "quality": cmd_quality,
        "lm-eval": cmd_lm_eval,
        "agent-replay": cmd_agent,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
