"""The FlashInfer backend on a CUDA device against the torch reference backend, on the tiny real
architectures of tests/factories.py (head_dim 64, which FlashInfer's kernels cover): logits of mixed
prefill/decode batches with chunked prefill and same-step prefix hits, CUDA-graph decode against
eager, and 32 greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.backend import kv_cache_shape
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.config import ModelConfig
from engine.cuda_graph import CudaGraphRunner, DecodeBuckets
from engine.weights.loader import load_model
from engine.models.decoder import DecoderForCausalLM
from scheduler.output import ScheduledRequest, SchedulerOutput
from tests.factories import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    pytest.importorskip("flashinfer")
    from engine.attention.flashinfer import FlashInferAttentionBackend

CUDA = torch.device("cuda")
NUM_PAGES = 128  # the scheduler's pages; page NUM_PAGES is the scratch page
SHAPE = dict(head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
# bf16 activations and KV in both backends; they differ in summation order only.
LOGIT_TOL = dict(rtol=2e-2, atol=5e-2)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DecoderForCausalLM:
    path: Path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **SHAPE)
    cfg = ModelConfig.from_checkpoint(path)
    return load_model(path, cfg, torch.bfloat16, CUDA, 512)


def caches_for(model: DecoderForCausalLM, block_size: int) -> list[torch.Tensor]:
    cfg = model.config
    shape = kv_cache_shape(NUM_PAGES + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=CUDA) for _ in range(cfg.num_layers)]


def flashinfer_backend(model: DecoderForCausalLM, block_size: int) -> FlashInferAttentionBackend:
    cfg = model.config
    return FlashInferAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, torch.bfloat16, CUDA)


def torch_backend(model: DecoderForCausalLM, block_size: int) -> TorchAttentionBackend:
    cfg = model.config
    return TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CUDA)


def token(pos: int) -> int:
    return (7 * pos + 3) % 500  # by position only: requests with the same length share a prefix


def step(block_size: int, *reqs: tuple[str, int, int, list[int]], tokens: dict[str, int] | None = None) -> ForwardBatch:
    """(id, start_pos, new tokens, block table); a decode's token may come from `tokens`."""
    scheduled = []
    for rid, start, n, table in reqs:
        ids = tuple(token(p) for p in range(start, start + n))
        if tokens and rid in tokens and n == 1:
            ids = (tokens[rid],)
        scheduled.append(ScheduledRequest(rid, ids, start, tuple(table), True))
    return build_forward_batch(SchedulerOutput(tuple(scheduled), ()), block_size, CUDA)


def pages(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def mixed_steps(bs: int) -> list[ForwardBatch]:
    """Chunked prefill next to decodes, and a request whose first two pages are another's."""
    per = 128 // bs  # pages per request: 128 tokens each
    a, b, c = pages(0, per), pages(per, per), pages(2 * per, per)
    c = a[: 32 // bs] + c[32 // bs:]  # c's first 32 tokens are a's
    batches = [step(bs, ("a", 0, 37, a), ("b", 0, 20, b)),
               step(bs, ("a", 37, 1, a), ("b", 20, 30, b), ("c", 32, 9, c))]
    for i in range(4):
        batches.append(step(bs, ("a", 38 + i, 1, a), ("b", 50 + i, 1, b), ("c", 41 + i, 1, c)))
    return batches


@torch.inference_mode()
@pytest.mark.parametrize("block_size", [16, 4])
def test_flashinfer_logits_equal_torch_for_mixed_prefill_and_decode(model: DecoderForCausalLM, block_size: int) -> None:
    runs = []
    for make in (torch_backend, flashinfer_backend):
        backend, caches = make(model, block_size), caches_for(model, block_size)
        logits = []
        for batch in mixed_steps(block_size):
            backend.plan(batch)
            hidden = model(batch.input_ids, batch.positions, caches, backend)
            logits.append(model.compute_logits(hidden[batch.logits_indices]))
        runs.append((logits, caches))
    (want, want_caches), (got, got_caches) = runs
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **LOGIT_TOL, msg=lambda m: f"step {i}: {m}")
    for g, w in zip(got_caches, want_caches):
        torch.testing.assert_close(g, w, **LOGIT_TOL)


@torch.inference_mode()
def test_graph_decode_equals_eager_decode(model: DecoderForCausalLM) -> None:
    bs = 16
    eager_backend, eager_caches = flashinfer_backend(model, bs), caches_for(model, bs)
    graph_backend, graph_caches = flashinfer_backend(model, bs), caches_for(model, bs)
    runner = CudaGraphRunner(model, graph_caches, graph_backend, DecodeBuckets((1, 2, 4, 8)), NUM_PAGES, 8)
    runner.capture()
    assert runner.captured_sizes == [1, 2, 4, 8]
    tables = {r: pages(8 * i, 8) for i, r in enumerate("abcde")}
    lens = {"a": 5, "b": 17, "c": 33, "d": 16, "e": 1}
    batches = [step(bs, *[(r, 0, n, tables[r]) for r, n in lens.items()])]
    for i in range(3):  # 5 decodes (bucket 8), then 3 (bucket 4), then 2 (bucket 2)
        live = "abcde"[: 5 - i - (i > 0)]
        batches.append(step(bs, *[(r, lens[r] + i, 1, tables[r]) for r in live]))
    sizes = []
    for batch in batches:
        sizes.append(runner.graph_size_for(batch))
        got = runner.forward(batch).clone()
        eager_backend.plan(batch)
        want = model(batch.input_ids, batch.positions, eager_caches, eager_backend)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert sizes == [None, 8, 4, 2]
    for g, w in zip(graph_caches, eager_caches):
        torch.testing.assert_close(g[:NUM_PAGES], w[:NUM_PAGES], rtol=1e-2, atol=1e-2)


def greedy(model: DecoderForCausalLM, make: Callable[..., Any], prompt_lens: list[int],
           num_tokens: int) -> list[list[int]]:
    bs = 16
    backend, caches = make(model, bs), caches_for(model, bs)
    tables = {f"r{i}": pages(8 * i, 8) for i in range(len(prompt_lens))}
    lens = dict(zip(tables, prompt_lens))
    out: dict[str, list[int]] = {r: [] for r in tables}
    batch = step(bs, *[(r, 0, n, tables[r]) for r, n in lens.items()])
    for i in range(num_tokens):
        backend.plan(batch)
        hidden = model(batch.input_ids, batch.positions, caches, backend)
        for r, t in zip(batch.sample_request_ids, model.compute_logits(hidden[batch.logits_indices]).argmax(-1).tolist()):
            out[r].append(t)
        batch = step(bs, *[(r, lens[r] + i, 1, tables[r]) for r in tables], tokens={r: out[r][-1] for r in tables})
    return [out[r] for r in tables]


@torch.inference_mode()
def test_greedy_tokens_equal_across_backends_for_32_tokens(model: DecoderForCausalLM) -> None:
    prompt_lens = [1, 16, 17, 40, 63]
    assert greedy(model, flashinfer_backend, prompt_lens, 32) == greedy(model, torch_backend, prompt_lens, 32)
