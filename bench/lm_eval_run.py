"""`python -m bench lm-eval`: an lm-evaluation-harness loglikelihood run against fp4serve, as an
evaluation team runs it: `fp4serve serve` on a free port, lm-eval's `local-completions` model
(which posts `echo`, `max_tokens` 1, `logprobs` 1 and token-id prompts to /v1/completions and
sums the continuation's prompt logprobs) on the local task `fp4serve_easy`
(bench/lm_eval_tasks/, no hub and no download), then the server stopped.

Then the check that nothing silently lands at chance (llama.cpp issue 27174): the same
loglikelihoods computed with `transformers` directly on the served float32 checkpoint, split into
context and continuation tokens as lm-eval splits them, must give the same per-choice values
(within --tolerance nats) and the same acc and acc_norm.

lm-eval is not a dependency of fp4serve (with its own dependencies it is ~640 MB: datasets,
pandas, pyarrow, scipy, scikit-learn): install `lm_eval[api]` where you like (`make lm-eval` makes
a venv that reuses this one's torch) and pass its `lm_eval` with --lm-eval or $LM_EVAL."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.serve import EndpointError
from bench.spawned import SpawnedServer

TASK = "fp4serve_easy"
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
REPO = Path(__file__).resolve().parents[1]
NUM_CHOICES = 4
CHANCE = 1 / NUM_CHOICES
DEFAULT_TOLERANCE = 1e-3  # nats per choice: the server's float32 prefill against transformers' float32 forward
# The server for the run: float32 like the reference, a context far above the task's prompts.
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "2048")
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class Question:
    """One document of lm-eval's samples: its choices' (context, continuation) requests and the
    loglikelihood the server gave each."""

    doc_id: int
    gold: int
    choices: list[str]
    requests: list[tuple[str, str]]
    loglikelihoods: list[float]


@dataclass(frozen=True)
class Check:
    acc: float
    acc_norm: float
    reference_acc: float
    reference_acc_norm: float
    max_abs_diff: float
    num_choices: int

    def passed(self, tolerance: float) -> bool:
        return (
            self.max_abs_diff <= tolerance
            and self.acc == self.reference_acc
            and self.acc_norm == self.reference_acc_norm
        )


def find_lm_eval(given: str | None) -> str:
    """The `lm_eval` executable: --lm-eval, $LM_EVAL, beside this Python, or on PATH."""
    candidates = [
        given,
        os.environ.get("LM_EVAL"),
        str(Path(sys.executable).with_name("lm_eval")),
        shutil.which("lm_eval"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise EndpointError(
        "no lm_eval executable: install lm_eval[api] (`make lm-eval` makes a venv for it) "
        "and pass --lm-eval PATH or set $LM_EVAL"
    )


def lm_eval_command(
    lm_eval: str, base_url: str, model: str, tokenizer: Path, out_dir: Path, num_concurrent: int, limit: int | None
) -> list[str]:
    model_args = ",".join(
        [
            f"base_url={base_url.rstrip('/')}/completions",
            f"model={model}",
            "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer}",
            f"num_concurrent={num_concurrent}",
            "max_retries=1",
        ]
    )
    command = [
        lm_eval,
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(TASKS_DIR.relative_to(REPO)),
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]
    return command + (["--limit", str(limit)] if limit else [])


def read_run(out_dir: Path) -> tuple[dict[str, Any], list[Question]]:
    """lm-eval's results document and its samples (the one run under `out_dir`)."""
    [results_path] = out_dir.rglob("results_*.json")
    [samples_path] = out_dir.rglob(f"samples_{TASK}_*.jsonl")
    results = orjson.loads(results_path.read_bytes())
    questions = []
    for line in samples_path.read_bytes().splitlines():
        sample = orjson.loads(line)
        arguments = sample["arguments"]
        requests = [
            (arguments[k]["arg_0"], arguments[k]["arg_1"])
            for k in sorted(arguments, key=lambda k: int(k.rsplit("_", 1)[1]))
        ]
        questions.append(
            Question(
                sample["doc_id"],
                int(sample["doc"]["gold"]),
                sample["doc"]["choices"],
                requests,
                [float(resp[0]) for resp in sample["filtered_resps"]],
            )
        )
    return results, questions


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation token ids as lm-eval's causal models split them: trailing spaces
    of the context move to the continuation, the whole is tokenized (no special tokens) and the
    context's own tokenization cut from its front."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    head = tokenizer(context, add_special_tokens=False).input_ids
    return whole[: len(head)], whole[len(head) :]


def reference_loglikelihoods(folder: Path, requests: list[tuple[str, str]], batch: int = 32) -> list[float]:
    """Each continuation's summed log-probability given its context, from transformers' float32
    forward of the checkpoint folder (right-padded batches: a causal model's logits at a position
    never see the padding after it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pairs = [encode_pair(tokenizer, context, continuation) for context, continuation in requests]
    out = []
    with torch.inference_mode():
        for start in range(0, len(pairs), batch):
            chunk = pairs[start : start + batch]
            width = max(len(head) + len(tail) for head, tail in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, (head, tail) in enumerate(chunk):
                ids[row, : len(head) + len(tail)] = torch.tensor(head + tail)
            logprobs = torch.log_softmax(model(ids).logits.float(), dim=-1)
            for row, (head, tail) in enumerate(chunk):
                positions = torch.arange(len(head) - 1, len(head) + len(tail) - 1)
                out.append(float(logprobs[row, positions, ids[row, positions + 1]].sum()))
    return out


def accuracy(questions: list[Question], loglikelihoods: list[list[float]]) -> tuple[float, float]:
    """lm-eval's multiple-choice acc (the highest loglikelihood is the gold choice) and acc_norm
    (the same, each divided by its choice's length in characters)."""

    def argmax(values: list[float]) -> int:
        return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first, as numpy's

    right = right_norm = 0
    for q, lls in zip(questions, loglikelihoods, strict=True):
        right += argmax(lls) == q.gold
        right_norm += argmax([ll / len(choice) for ll, choice in zip(lls, q.choices, strict=True)]) == q.gold
    return right / len(questions), right_norm / len(questions)


def check_run(results: dict[str, Any], questions: list[Question], folder: Path) -> Check:
    requests = [r for q in questions for r in q.requests]
    flat = reference_loglikelihoods(folder, requests)
    reference, i = [], 0
    for q in questions:
        reference.append(flat[i : i + len(q.requests)])
        i += len(q.requests)
    served = [q.loglikelihoods for q in questions]
    reported = results["results"][TASK]
    acc, acc_norm = accuracy(questions, served)
    assert math.isclose(acc, reported["acc,none"]) and math.isclose(acc_norm, reported["acc_norm,none"]), (
        f"lm-eval's reported scores {reported} differ from its samples' ({acc}, {acc_norm})"
    )
    ref_acc, ref_acc_norm = accuracy(questions, reference)
    diff = max(abs(a - b) for s, r in zip(served, reference, strict=True) for a, b in zip(s, r, strict=True))
    return Check(acc, acc_norm, ref_acc, ref_acc_norm, diff, len(requests))


def model_folder(model: str | None) -> Path:
    """The checkpoint folder the server loads for --model (a GGUF is converted once, as the server does)."""
    from engine.config import EngineConfig
    from engine.weights.model_path import resolve_model_path

    return resolve_model_path(EngineConfig(model=model))[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lm-eval", default=None, help="the lm_eval executable (default: $LM_EVAL, one beside this Python, or on PATH)"
    )
    p.add_argument(
        "--model", default=None, help="`fp4serve serve --model` (default: the default model, SmolLM2-135M-Instruct)"
    )
    p.add_argument("--server-args", default="", help="more `fp4serve serve` flags, one string")
    p.add_argument("--num-concurrent", type=int, default=4, help="lm-eval's concurrent requests (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions (lm-eval --limit)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest per-choice |served - transformers| loglikelihood in nats (default: %(default)s)",
    )
    p.add_argument("--out", default=None, help="keep lm-eval's results and samples in this folder")


def cmd_lm_eval(args: argparse.Namespace) -> int:
    import shlex

    from engine.weights.model_source import model_name

    try:
        lm_eval = find_lm_eval(args.lm_eval)
        folder = model_folder(args.model)
        served_name = model_name(args.model)
        extra = ["--model", args.model] if args.model else []
        server = SpawnedServer(extra + shlex.split(args.server_args), base_args=SERVER_ARGS, name="lm-eval")
    except EndpointError as e:
        print(f"bench lm-eval: {e}", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fp4serve-lm-eval-"))
    shutil.rmtree(out_dir, ignore_errors=True)
    command = lm_eval_command(lm_eval, server.base_url, served_name, folder, out_dir, args.num_concurrent, args.limit)
    print("$ " + shlex.join(command), flush=True)
    started = time.monotonic()
    try:
        run = subprocess.run(command, cwd=REPO, env={**os.environ, **OFFLINE}, capture_output=True, text=True)
    finally:
        server.stop()
    seconds = time.monotonic() - started
    if run.returncode != 0:
        print(run.stdout[-4000:] + run.stderr[-4000:], file=sys.stderr)
        print(f"bench lm-eval: lm_eval exited {run.returncode}", file=sys.stderr)
        return 1
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith("|")))
    results, questions = read_run(out_dir)
    check = check_run(results, questions, folder)
    print(
        f"lm-eval {results.get('lm_eval_version')}, {len(questions)} questions of {NUM_CHOICES} choices "
        f"(chance {CHANCE:.2f}), {check.num_choices} loglikelihood requests in {seconds:.0f} s"
    )
    print(
        f"transformers float32 on {folder}: acc {check.reference_acc:.2f}, acc_norm "
        f"{check.reference_acc_norm:.2f}; per-choice loglikelihood max |served - transformers| "
        f"{check.max_abs_diff:.2e} nats (tolerance {args.tolerance:g})"
    )
    if not check.passed(args.tolerance):
        print("bench lm-eval: the served loglikelihoods do not match transformers'", file=sys.stderr)
        return 1
    print(f"OK: acc {check.acc:.2f} = transformers' (chance {CHANCE:.2f})")
    return 0
