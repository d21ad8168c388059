"""`bench peers`' cold prefill: the time to first token of a fresh prompt (never seen by the server,
so no prefix cache helps) at each of a few lengths, one request at a time, measured as the latency
of a one-token answer; and its markdown table, one row per server and round."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from bench.datasets import DatasetSpec, LocalTokenizer, TokenCounter, build_dataset, load_tokenizer

# ~1k and ~4.5k prompt tokens: a long question, and a file or a long conversation pasted in.
DEFAULT_PREFILL_LENS = (1024, 4608)


def prefill_tokenizer(path: str | None) -> TokenCounter:
    """The model's tokenizer when its folder is here (exact lengths), else one word a token."""
    if path and (Path(path) / "tokenizer.json").is_file():
        return LocalTokenizer(path)
    return load_tokenizer(None, None, None, None)


def prefill_prompts(lengths: Sequence[int], tokenizer: TokenCounter, seed: int) -> list[tuple[int, str]]:
    """(tokens, text) of a random prompt of each length; a different `seed` gives other texts, so
    every server (and every round) meets prompts it has never cached."""
    return [
        (
            n,
            build_dataset(DatasetSpec("random", 1, input_len=n, output_len=1, seed=seed + i), tokenizer)[0]
            .turns[0]
            .text,
        )
        for i, n in enumerate(lengths)
    ]


def cold_prefill(
    base_url: str, model: str, text: str, timeout_s: float, extra_body: Mapping[str, object] | None = None
) -> dict[str, object]:
    """One chat request for a single token: its latency in seconds and the prompt tokens the
    server counted (None where it does not say); or the error."""
    body = {
        "model": model,
        "max_tokens": 1,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": text}],
        **(extra_body or {}),
    }
    start = time.perf_counter()
    try:
        resp = httpx.post(base_url + "/chat/completions", json=body, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    elapsed = time.perf_counter() - start
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
    usage = resp.json().get("usage") or {}
    return {"ttft_s": round(elapsed, 3), "prompt_tokens": usage.get("prompt_tokens")}


def measure_cold_prefill(
    base_url: str, model: str, prompts: Sequence[tuple[int, str]], timeout_s: float
) -> list[dict[str, object]]:
    """`cold_prefill` of each prompt in turn, shortest first."""
    return [{"target_tokens": n, **cold_prefill(base_url, model, text, timeout_s)} for n, text in prompts]


def format_prefill(servers: Sequence[Mapping[str, object]], lengths: Sequence[int]) -> str:
    """Markdown: per server and round, the time to first token at each length (the prompt tokens
    the server counted in brackets)."""
    lines = [
        "| server | round | " + " | ".join(f"~{n} tokens: TTFT (s)" for n in lengths) + " |",
        "|---|---:|" + "---:|" * len(lengths),
    ]
    for s in servers:
        measured = {m.get("target_tokens"): m for m in s.get("prefill") or [] if isinstance(m, dict)}
        if not measured:
            continue
        cells = []
        for n in lengths:
            m = measured.get(n) or {}
            if "ttft_s" in m:
                counted = f" ({m['prompt_tokens']})" if m.get("prompt_tokens") is not None else ""
                cells.append(f"{m['ttft_s']:.2f}{counted}")
            else:
                cells.append(f"failed: {str(m.get('error', 'not run')).splitlines()[0][:60]}")
        lines.append(f"| {s['server']} | {s.get('round', 1)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
