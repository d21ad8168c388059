"""Hybrid prefix caching as a user meets it: a real server (subprocess) with a tiny hybrid in
Qwen3.6-27B's layout, the official `openai` client. An agent-style chat reports most of each later
turn's prompt in usage.prompt_tokens_details.cached_tokens, users sharing a system prompt get
nearly all of it cached, greedy output equals transformers, and the start-up log, /metrics and
/stats show the cache at work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_engine_correctness import hf_greedy
from tests.engine.test_hybrid_prefix_cache import LAYOUT_27B, words
from tests.factories import make_hybrid_checkpoint
from tests.server_utils import HTTP, RunningServer, start_server

pytestmark = pytest.mark.slow


def text(n: int, seed: int) -> str:
    return " ".join(f"w{i}" for i in words(n, seed))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_prefix_server"), **LAYOUT_27B)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    s = start_server(
        "--model",
        str(checkpoint),
        "--served-model-name",
        "hybrid",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "1024",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


def chat(server: RunningServer, messages: list[dict[str, str]]) -> Any:
    return server.openai().chat.completions.create(
        model="hybrid",
        messages=messages,
        max_tokens=6,
        temperature=0.0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def test_agent_turns_report_their_cached_prompt_through_the_openai_sdk(server: RunningServer, checkpoint: Path) -> None:
    messages = [{"role": "system", "content": text(180, 1)}, {"role": "user", "content": text(30, 2)}]
    shares = []
    for turn in range(5):
        r = chat(server, messages)
        shares.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "tool" if turn % 2 else "user", "content": text(25, 10 + turn)},
        ]
    assert shares[0] == 0 and min(shares[1:]) >= 0.8, shares
    prompt, got = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert got == hf_greedy(checkpoint, prompt, 6)[0]
    log = server.log()
    assert "hybrid prefix caching on: " in log and "state checkpoints x" in log


def test_users_sharing_an_odd_length_system_prompt_get_it_cached(server: RunningServer) -> None:
    system = {"role": "system", "content": text(333, 3)}
    replies = [chat(server, [system, {"role": "user", "content": text(12, 20 + u)}]) for u in range(3)]
    prompts = [r.model_extra["prompt_token_ids"] for r in replies]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)  # the common prefix
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[0] == 0 and min(cached[1:]) >= 0.9 * shared, (cached, shared)
    stats = HTTP.get(server.url("/stats")).json()
    assert stats["prefix_cache"]["hit_rate"] > 0.3
    metrics = HTTP.get(server.url("/metrics")).text
    hits = next(line for line in metrics.splitlines() if line.startswith("fp4serve_prefix_cache_hits_total"))
    assert float(hits.split()[-1]) >= sum(cached)
