"""MTP speculative decoding through the real server and the `openai` client: concurrent greedy
streams equal the engine's output without speculation, /metrics counts MTP drafts, and the
start-up log says MTP is on and how many mtp.* tensors were loaded."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.request import SamplingParams
from tests.engine.test_spec_decode import make_engine
from tests.engine.test_spec_mtp import random_prompts
from tests.factories import make_hybrid_checkpoint
from tests.mtp_factory import add_mtp_tensors
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_tensors(make_hybrid_checkpoint(tmp_path_factory.mktemp("mtp_server")))


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[RunningServer]:
    s = start_server(
        "--model",
        str(ckpt),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--speculative-method",
        "mtp",
        "--num-speculative-tokens",
        "3",
        "--speculative-max-batch",
        "8",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


def test_streams_equal_unspeculated_greedy(server: RunningServer, ckpt: Path) -> None:
    ps = random_prompts(4, 11, 26, seed=13)
    ref = make_engine(ckpt, enable_prefix_caching=False).generate(
        ps, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    client = server.async_openai()

    async def one(prompt: list[int]) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        return await asyncio.gather(*(one(p) for p in ps))

    assert asyncio.run(main()) == [r.texts[0] for r in ref]
    text = HTTP.get(server.url("/metrics")).text
    assert metric(text, "fp4serve_spec_decode_draft_tokens_total") > 0
    log = server.log()
    assert "speculative decoding: mtp" in log
    assert "MTP head loaded: 15 mtp.* tensors" in log
