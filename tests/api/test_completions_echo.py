"""/v1/completions `echo`, prompt logprobs and vLLM's `prompt_logprobs`, on a real server with the
official `openai` client; the prompt's logprobs checked against transformers' log-softmax."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.engine.test_prompt_logprobs import reference
from tests.server_utils import RunningServer, running_server

pytestmark = pytest.mark.slow  # a real server in a subprocess: `make test-fast` skips it

PROMPT = "w5 w17 w300 w42 w8 w99 w3 w250 w7 w11"
IDS = [int(w[1:]) for w in PROMPT.split()]


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path) -> Iterator[RunningServer]:
    with running_server("--model", str(qwen3_ckpt), "--dtype", "float32", "--kv-cache-memory", "4MiB") as s:
        yield s


@pytest.fixture(scope="module")
def want(qwen3_ckpt: Path) -> torch.Tensor:
    return reference(qwen3_ckpt, IDS)


def model(server: RunningServer) -> str:
    return server.openai().models.list().data[0].id


def test_echo_with_max_tokens_0_returns_the_prompt_scored_by_the_model(
    server: RunningServer, want: torch.Tensor
) -> None:
    out = server.openai().completions.create(model=model(server), prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (10, 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == PROMPT.split()
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    for p in range(1, len(IDS)):
        assert lp.token_logprobs[p] == pytest.approx(float(want[p - 1, IDS[p]]), abs=1e-4)
        values, ids = want[p - 1].topk(2)
        assert lp.top_logprobs[p] == pytest.approx(
            {f"w{i}": v for i, v in zip(ids.tolist(), values.tolist())}, abs=1e-4
        )


def test_echo_puts_the_prompt_before_the_completion(server: RunningServer) -> None:
    client = server.openai()
    plain = client.completions.create(model=model(server), prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    echoed = client.completions.create(
        model=model(server), prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs.tokens == PROMPT.split() + plain.choices[0].logprobs.tokens
    assert echoed.usage.completion_tokens == 4
    stream = client.completions.create(
        model=model(server), prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == echoed.choices[0].text


def test_vllm_prompt_logprobs_list_the_prompt_token_and_the_top_ones(server: RunningServer, want: torch.Tensor) -> None:
    out = server.openai().completions.create(
        model=model(server), prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(IDS) and scored[0] is None
    for p in range(1, len(IDS)):
        entry = scored[p][str(IDS[p])]
        assert entry["decoded_token"] == f"w{IDS[p]}"
        assert entry["logprob"] == pytest.approx(float(want[p - 1, IDS[p]]), abs=1e-4)
        assert str(int(want[p - 1].argmax())) in scored[p]


def test_max_tokens_0_without_echo_is_a_400(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.openai().completions.create(model=model(server), prompt=PROMPT, max_tokens=0)


def test_bench_quality_perplexity_is_transformers_over_the_same_windows(
    server: RunningServer, qwen3_ckpt: Path
) -> None:
    from bench.quality import agreement, run_quality, windows

    text = " ".join(f"w{(i * 37) % 500}" for i in range(30))
    _, scored, size = run_quality(server.url("/v1"), None, text, window=8, max_tokens=25)
    ids = [(i * 37) % 500 for i in range(25)]
    parts = windows(ids, 8, 25)
    assert size == 8 and [len(p) for p in parts] == [8, 8, 8] and len(scored.logprobs) == 21  # 25th: a window of 1
    want = [reference(qwen3_ckpt, part) for part in parts]
    nll = -sum(float(w[p - 1, part[p]]) for w, part in zip(want, parts) for p in range(1, len(part)))
    assert scored.perplexity == pytest.approx(torch.exp(torch.tensor(nll / 21)).item(), rel=1e-4)
    assert scored.top1_ids == [int(w[p - 1].argmax()) for w, part in zip(want, parts) for p in range(1, len(part))]
    assert agreement(scored, scored) == 1.0
