"""Chunked prefill on CPU without a materialised mask (engine/attention/torch_ref.py,
`chunk_attention`): a chunk's queries against its earlier keys unmasked and its own keys causal,
merged by their log-sum-exps, held to the masked float32 reference over the paged cache
(kernels/cpu_attention.py, paged_attention_ref) for several cached lengths, chunk lengths, GQA
ratios, page sizes and dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.attention.torch_ref as torch_ref
from engine.attention.torch_ref import TorchAttentionBackend, chunk_attention
from kernels.cpu_attention import paged_attention_ref
from tests.kernels.test_cpu_attention import make_batch

CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def attend(
    backend: TorchAttentionBackend,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's output on a random batch, and the masked reference's over the same cache."""
    num_heads, num_kv_heads = heads
    num_pages = sum(-(-n // block_size) for n in seq_lens) + 3
    batch = make_batch(query_lens, seq_lens, block_size, num_pages, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.num_tokens, num_heads, 64, generator=g).to(dtype)
    k, v = (torch.randn(batch.num_tokens, num_kv_heads, 64, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(num_pages, 2, block_size, num_kv_heads, 64, generator=g).to(dtype)
    backend.plan(batch)
    out = backend.forward(q, k, v, cache)  # writes the new K/V into `cache` before attending
    ref = paged_attention_ref(
        q, cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, backend.scale
    )
    return out, ref


@pytest.mark.parametrize("cached", [0, 5, 37, 300])
@pytest.mark.parametrize("chunk", [17, 64, 200])
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (6, 6)], ids=["gqa2", "gqa3", "mha"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_a_chunk_attends_like_the_masked_reference(
    cached: int, chunk: int, heads: tuple[int, int], block_size: int
) -> None:
    backend = TorchAttentionBackend(heads[0], heads[1], 64, CPU)
    out, ref = attend(backend, [chunk], [cached + chunk], block_size, heads, F32, seed=cached + chunk)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_chunks_decodes_and_reduced_precision_in_one_batch(dtype: torch.dtype) -> None:
    backend = TorchAttentionBackend(9, 3, 64, CPU)
    out, ref = attend(backend, [1, 130, 1, 48, 33], [40, 400, 7, 48, 90], 16, (9, 3), dtype, seed=3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)  # one output rounding


def test_chunk_attention_alone_against_a_masked_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    cached, chunk = 1000, 300
    q = torch.randn(1, 8, chunk, 64, generator=g) * 3  # wide logits: the merge's weights far from 1/2
    keys, values = (torch.randn(1, 2, cached + chunk, 64, generator=g) for _ in range(2))
    mask = torch.arange(cached + chunk)[None, :] <= torch.arange(cached, cached + chunk)[:, None]
    ref = F.scaled_dot_product_attention(
        q.double(), keys.double(), values.double(), attn_mask=mask, scale=0.125, enable_gqa=True
    )
    torch.testing.assert_close(
        chunk_attention(q, keys, values, 0.125).double(), ref, rtol=1e-5, atol=1e-5
    )  # float32 sums


def test_a_cpu_chunk_builds_no_mask_and_calls_no_masked_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def watched_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    backend = TorchAttentionBackend(4, 2, 64, CPU)
    batch = make_batch([64, 40], [300, 40], 16, 30, seed=1)  # two chunks, no decodes
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, 4, 64, generator=g)
    k, v = (torch.randn(batch.num_tokens, 2, 64, generator=g) for _ in range(2))
    cache = torch.randn(30, 2, 16, 2, 64, generator=g)
    backend.plan(batch)
    with monkeypatch.context() as m:
        m.setattr(torch_ref.F, "scaled_dot_product_attention", watched_sdpa)
        out = backend.forward(q, k, v, cache)
    assert calls == [] and all(p.mask is None for p in backend._prefills)
    ref = paged_attention_ref(
        q, cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, backend.scale
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
