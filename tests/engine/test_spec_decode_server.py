"""n-gram speculative decoding through the real server and the `openai` client: concurrent greedy
streams equal the engine's output without speculation, a chunk may carry several tokens, the
per-request opt-out is an extra body field, and /metrics counts drafts and acceptances."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.request import SamplingParams
from tests.engine.test_spec_decode import make_engine, prompts
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path) -> Iterator[RunningServer]:
    s = start_server(
        "--model",
        str(qwen3_ckpt),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "4",
        "--speculative-max-batch",
        "8",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


def test_streams_equal_unspeculated_greedy_and_metrics_count(server: RunningServer, qwen3_ckpt: Path) -> None:
    ps = prompts()[:4]
    ref = make_engine(qwen3_ckpt).generate(ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    client = server.async_openai()

    async def one(prompt: list[int], opt_out: bool) -> list[str]:
        extra = {"ignore_eos": True, **({"speculative_decoding": False} if opt_out else {})}
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=30, temperature=0.0, stream=True, extra_body=extra
        )
        return [c.choices[0].text async for c in stream if c.choices]

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(one(p, opt_out=i == 3) for i, p in enumerate(ps)))

    chunks = asyncio.run(main())
    assert ["".join(c) for c in chunks] == [r.texts[0] for r in ref]
    assert any(len(c.split()) > 1 for c in chunks[0] + chunks[1]), "an SSE chunk carries several tokens"
    assert all(len(c.split()) <= 1 for c in chunks[3]), "the opted-out request drafts nothing"
    text = HTTP.get(server.url("/metrics")).text
    drafted = metric(text, "fp4serve_spec_decode_draft_tokens_total")
    accepted = metric(text, "fp4serve_spec_decode_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert metric(text, 'fp4serve_spec_decode_accepted_tokens_per_position_total{position="0"}') > 0
    # Every emitted token counts, several per step (/v1/usage: under the key, `default` without keys).
    assert metric(text, "fp4serve_generation_tokens_total") == 4 * 30
    usage = HTTP.get(server.url("/v1/usage")).json()
    assert [(row["key"], row["completion_tokens"]) for row in usage["data"]] == [("default", 4 * 30)]
    assert "speculative decoding: ngram" in server.log()
