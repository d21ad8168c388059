"""`python -m bench quality`: a served model's perplexity on real text, through /v1/completions
with `echo`, `max_tokens` 0 and prompt logprobs (vLLM's semantics), in windows of the context
length; with `--reference`, top-1 agreement with another run over the same tokens.

The text is tokenized once by the server (POST /tokenize, vLLM's) and cut into non-overlapping
windows; each window's first token has no logprob, so it is not scored. The default text ships
with every Python install: the standard library's `pydoc_data/topics.py` documentation."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from bench.serve import EndpointError, discover_model

DEFAULT_MAX_TOKENS = 16_384


@dataclass(frozen=True)
class Scored:
    """Per scored token, in text order: its logprob and the token id the model ranked first."""

    logprobs: list[float]
    top1_ids: list[int]
    target_ids: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def default_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def windows(token_ids: list[int], size: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of `size` tokens covering the first `max_tokens` (the last may be
    shorter; one of a single token scores nothing and is dropped)."""
    assert size >= 2, "a window needs two tokens to score one"
    ids = token_ids[:max_tokens]
    return [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]


def score_window(client: httpx.Client, model: str, window: list[int]) -> Scored:
    body = {
        "model": model,
        "prompt": window,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs": 1,
        "temperature": 0,
    }
    response = client.post("/completions", json=body)
    if response.status_code != 200:
        raise EndpointError(f"/completions answered {response.status_code}: {response.text[:300]}")
    choice = response.json()["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    scored = choice["prompt_logprobs"]
    assert len(token_logprobs) == len(window) and token_logprobs[0] is None, "echo must score each prompt token"
    top1 = [int(max(entry.items(), key=lambda kv: kv[1]["logprob"])[0]) for entry in scored[1:]]
    return Scored([float(x) for x in token_logprobs[1:]], top1, window[1:])


def tokenize(base_url: str, model: str, text: str, headers: dict[str, str]) -> tuple[list[int], int]:
    """Token ids and the server's max_model_len, from POST /tokenize at the server root."""
    root = base_url.rstrip("/").removesuffix("/v1")
    response = httpx.post(
        root + "/tokenize",
        json={"model": model, "prompt": text, "add_special_tokens": False},
        headers=headers,
        timeout=300.0,
        trust_env=False,
    )
    if response.status_code != 200:
        raise EndpointError(f"{root}/tokenize answered {response.status_code}: {response.text[:300]}")
    body = response.json()
    return body["tokens"], int(body["max_model_len"])


def run_quality(
    base_url: str, model: str | None, text: str, window: int | None, max_tokens: int, api_key: str | None = None
) -> tuple[str, Scored, int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or discover_model(base_url, api_key)
    token_ids, max_model_len = tokenize(base_url, model, text, headers)
    size = min(window or max_model_len - 1, max_model_len - 1)  # the engine runs one token past the prompt
    parts: list[Scored] = []
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=3600.0, trust_env=False) as client:
        for chunk in tqdm(windows(token_ids, size, max_tokens), desc="quality", unit="window", file=sys.stderr):
            parts.append(score_window(client, model, chunk))
    merged = Scored(
        [x for p in parts for x in p.logprobs],
        [x for p in parts for x in p.top1_ids],
        [x for p in parts for x in p.target_ids],
    )
    return model, merged, size


def agreement(a: Scored, b: Scored) -> float:
    assert a.target_ids == b.target_ids, "the runs scored different tokens (another tokenizer, window or text?)"
    return sum(x == y for x, y in zip(a.top1_ids, b.top1_ids)) / len(a.top1_ids)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name; default: the first of GET /models")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument(
        "--text",
        default=None,
        help="a UTF-8 text file; default: the standard library's pydoc_data/topics.py documentation strings",
    )
    p.add_argument(
        "--window", type=int, default=None, help="tokens per window; default: the server's context length less one"
    )
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="score the text's first N tokens")
    p.add_argument(
        "--reference",
        default=None,
        help="a result file of another run over the same tokens: report top-1 agreement with it",
    )
    p.add_argument("--out", default=None, help="write the result (per-token logprobs and top-1 ids) as JSON here")


def cmd_quality(args: argparse.Namespace) -> int:
    text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
    try:
        model, scored, size = run_quality(args.base_url, args.model, text, args.window, args.max_tokens, args.api_key)
    except EndpointError as e:
        print(f"bench quality: {e}", file=sys.stderr)
        return 1
    source = args.text or "pydoc_data/topics.py"
    print(f"quality: {model} on {source}: {len(scored.logprobs)} tokens scored in windows of {size}")
    print(f"  perplexity {scored.perplexity:.4f}  (mean NLL {-sum(scored.logprobs) / len(scored.logprobs):.4f} nats)")
    if args.reference:
        ref = _load(Path(args.reference))
        diffs = [abs(x - y) for x, y in zip(scored.logprobs, ref.logprobs)]
        print(
            f"  vs {args.reference}: top-1 agreement {agreement(scored, ref):.2%} over {len(scored.top1_ids)} "
            f"positions; perplexity {ref.perplexity:.4f} there (ratio {scored.perplexity / ref.perplexity:.4f}); "
            f"mean |d logprob| {sum(diffs) / len(diffs):.4f}"
        )
    if args.out:
        document: dict[str, Any] = {
            "model": model,
            "text": source,
            "window": size,
            "perplexity": scored.perplexity,
            "logprobs": scored.logprobs,
            "top1_ids": scored.top1_ids,
            "target_ids": scored.target_ids,
        }
        Path(args.out).write_bytes(orjson.dumps(document))
    return 0


def _load(path: Path) -> Scored:
    doc = orjson.loads(path.read_bytes())
    return Scored(doc["logprobs"], doc["top1_ids"], doc["target_ids"])
