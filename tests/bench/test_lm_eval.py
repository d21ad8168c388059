"""lm-evaluation-harness's `local-completions` loglikelihood requests against a real server
(`fp4serve serve` in a subprocess, the tiny demo model, float32), checked against transformers.

lm-eval itself is not in the test venv (with its dependencies it is ~640 MB), so the first test
posts exactly the body its `local-completions` model posts for a loglikelihood request (lm-eval
0.4.13, lm_eval/models/openai_completions.py `_create_payload` with generate=False: token-id
prompts, `echo`, `max_tokens` 1, `logprobs` 1, `temperature` 0, `seed`) and reads the reply as its
`parse_logprobs` does: the sum of `token_logprobs[ctxlen:-1]`, and `top_logprobs` for is_greedy.
The second runs the real thing, `python -m bench lm-eval`, when an `lm_eval` executable is there
($LM_EVAL, beside this Python, or on PATH)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import orjson
import pytest

from bench.lm_eval_questions import QUESTIONS_PATH
from bench.lm_eval_run import EndpointError, encode_pair, find_lm_eval, model_folder, reference_loglikelihoods
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.server_utils import REPO, running_server

pytestmark = pytest.mark.slow

SEED = 1234  # lm-eval's default


def lm_eval_body(prompts: list[list[int]]) -> dict:
    return {
        "model": DEMO_MODEL_NAME,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": SEED,
        "echo": True,
    }


def requests_of_the_task(num_questions: int) -> list[tuple[str, str]]:
    """(context, continuation) as lm-eval builds them for the task: the question, " " + a choice."""
    lines = QUESTIONS_PATH.read_bytes().splitlines()[:num_questions]
    return [(q["question"], " " + choice) for q in map(orjson.loads, lines) for choice in q["choices"]]


def test_lm_evals_loglikelihood_requests_equal_transformers() -> None:
    from transformers import AutoTokenizer

    folder = model_folder(None)  # the demo (tests/conftest.py)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = requests_of_the_task(3) + [("The answer is ", "yes"), ("A", " long continuation of several tokens")]
    pairs = [encode_pair(tokenizer, context, continuation) for context, continuation in requests]
    expected = reference_loglikelihoods(folder, requests)
    with (
        running_server("--dtype", "float32") as server,
        httpx.Client(base_url=server.url("/v1"), timeout=120) as client,
    ):
        served = []
        # batch_size 1 (one prompt per request) for the first half, then batch_size 4.
        half = len(pairs) // 2
        batches = [[p] for p in pairs[:half]] + [pairs[i : i + 4] for i in range(half, len(pairs), 4)]
        for batch in batches:
            reply = client.post("/completions", json=lm_eval_body([head + tail for head, tail in batch]))
            assert reply.status_code == 200, reply.text
            choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
            assert len(choices) == len(batch)
            for choice, (head, tail) in zip(choices, batch, strict=True):
                token_logprobs = choice["logprobs"]["token_logprobs"]
                top = choice["logprobs"]["top_logprobs"]
                assert len(token_logprobs) == len(head) + len(tail) + 1 and token_logprobs[0] is None
                served.append(sum(token_logprobs[len(head) : -1]))
                # is_greedy reads one top-1 entry per token, never below the token's own logprob.
                for lp, entry in zip(token_logprobs[len(head) : -1], top[len(head) : -1], strict=True):
                    assert len(entry) == 1 and max(entry.values()) >= lp - 1e-6
    assert served == pytest.approx(expected, abs=1e-4)
    assert all(len(tail) >= 1 for _, tail in pairs) and len(served) == len(requests)


def test_lm_eval_itself_through_bench_lm_eval() -> None:
    try:
        lm_eval = find_lm_eval(None)
    except EndpointError:
        pytest.skip("no lm_eval executable (set $LM_EVAL to one; `make lm-eval` installs it)")
    run = subprocess.run(
        [sys.executable, "-m", "bench", "lm-eval", "--lm-eval", lm_eval, "--limit", "5"],
        cwd=REPO,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "|fp4serve_easy|" in run.stdout and "OK: acc" in run.stdout
