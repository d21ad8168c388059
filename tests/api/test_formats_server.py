"""The checkpoints of issue 31 served as users meet them, a real server on 127.0.0.1 read with the
official `openai` client: Qwen3-MoE in Qwen's block-wise FP8 layout, a Qwen3.5-MoE hybrid GGUF
written by llama.cpp's converter's rules, each greedy token for token equal to transformers; and an
NVFP4 hybrid whose MTP head comes from the FP8 release in a second folder (vLLM's
`--speculative-config`), equal to the body's own greedy output, drafting and accepting."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler.request import SamplingParams
from tests.engine.test_fp8_engine import prompts, transformers_greedy
from tests.engine.test_moe_server import complete_all, server_model
from tests.engine.test_spec_decode import make_engine
from tests.engine.test_spec_mtp_folder import split_release
from tests.factories import make_hybrid_checkpoint, make_hybrid_moe_checkpoint, make_moe_checkpoint
from tests.fp8_factory import dequantized_copy, to_fp8_checkpoint
from tests.gguf_factory import write_llamacpp_gguf
from tests.mtp_factory import add_mtp_tensors, make_predictable
from tests.server_utils import HTTP, metric, running_server

pytestmark = pytest.mark.slow

NUM_TOKENS = 10  # tests/engine/test_moe_server.py complete_all's max_tokens


def test_fp8_moe_checkpoint_serves_transformers_greedy(tmp_path: Path) -> None:
    fp8 = to_fp8_checkpoint(make_moe_checkpoint(tmp_path / "float", seed=3), tmp_path / "fp8")
    ps = prompts(seed=12)
    refs = transformers_greedy(dequantized_copy(fp8, tmp_path / "ref"), ps, NUM_TOKENS)
    with running_server(
        "--model", str(fp8), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "32"
    ) as server:
        got = asyncio.run(complete_all(server.async_openai(), server_model(server), ps))
        log = server.log()
    assert got == refs
    assert "checkpoint format: FP8 block-wise (e4m3, 128x128 blocks" in log and "weights resident:" in log


def test_hybrid_moe_gguf_serves_transformers_greedy(tmp_path: Path) -> None:
    src = make_hybrid_moe_checkpoint(tmp_path / "src", seed=5)
    path = write_llamacpp_gguf(src, tmp_path / "hybrid-moe.gguf")
    ps = prompts(seed=13)
    refs = transformers_greedy(src, ps, NUM_TOKENS)
    with running_server("--model", str(path), "--dtype", "float32", "--kv-cache-memory", "8MiB") as server:
        assert server_model(server) == "hybrid-moe"
        got = asyncio.run(complete_all(server.async_openai(), "hybrid-moe", ps))
        log = server.log()
    assert got == refs
    assert "qwen35moe" in log and "moe: 4 sparse layers x 8 experts" in log


def test_nvfp4_hybrid_with_the_fp8_mtp_head_of_a_second_folder(tmp_path: Path) -> None:
    full = make_predictable(add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "full", seed=4)))
    body, fp8 = split_release(full, tmp_path)
    ps = prompts(seed=14)
    ref = make_engine(body, enable_prefix_caching=False).generate(
        ps, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    )
    config = f'{{"method": "mtp", "num_speculative_tokens": 3, "model": "{fp8}"}}'
    with running_server(
        "--model",
        str(body),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--speculative-config",
        config,
        "--speculative-max-batch",
        "8",
    ) as server:
        got = asyncio.run(complete_all(server.async_openai(), server_model(server), ps))
        text = HTTP.get(server.url("/metrics")).text
        log = server.log()
    assert got == [r.token_ids[0] for r in ref]
    assert (
        0
        < metric(text, "fp4serve_spec_decode_accepted_tokens_total")
        < metric(text, "fp4serve_spec_decode_draft_tokens_total")
    )
    assert f"MTP head loaded: 15 mtp.* tensors from {fp8} (FP8, dequantized)" in log
