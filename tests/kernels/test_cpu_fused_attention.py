"""RoPE, the cache write and paged attention as one CPU op (kernels/cpu_fused_attention.cpp)
against the same steps through the references, and the CPU backend's use of it."""

from __future__ import annotations

import pytest
import torch

from engine.host.cpu_kernels import load_cpu_ops
from kernels.cpu_attention import rope_cache_attention, rope_cache_attention_ref

BS = 4  # tokens per page


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


def case(
    dtype: torch.dtype,
    seq_lens: list[int],
    q_lens: list[int],
    hq: int = 6,
    hkv: int = 2,
    d: int = 16,
) -> tuple[torch.Tensor, ...]:
    """A cache holding each request's earlier keys on shuffled pages, and this step's qkv rows."""
    pages_per = [(n + BS - 1) // BS for n in seq_lens]
    order = torch.randperm(sum(pages_per) + 2)[: sum(pages_per)].int()  # page ids, two spare pages
    cache = torch.randn(sum(pages_per) + 2, 2, BS, hkv, d).to(dtype)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n - 1) % BS + 1 for n in seq_lens], dtype=torch.int32)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        pages = order[kv_indptr[i] : kv_indptr[i + 1]].tolist()
        slots += [pages[p // BS] * BS + p % BS for p in range(n - q, n)]  # the new rows: the last q positions
    rows = sum(q_lens)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d).to(dtype)
    angle = torch.rand(rows, d // 2) * 6
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(dtype)
    signed_sin = torch.cat([-angle.sin(), angle.sin()], dim=-1).to(dtype)
    return qkv, cos, signed_sin, cache, torch.tensor(slots, dtype=torch.int64), qo_indptr, kv_indptr, order, last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,q_lens", [([1], [1]), ([9, 4, 13], [1, 1, 1]), ([7, 5], [3, 2])])
def test_rope_cache_attention_equals_the_reference_steps(
    dtype: torch.dtype, seq_lens: list[int], q_lens: list[int]
) -> None:
    torch.manual_seed(len(seq_lens) * 10 + sum(q_lens))
    qkv, cos, ssin, cache, slots, qo, kv_ptr, kv_idx, last = case(dtype, seq_lens, q_lens)
    ref_cache = cache.clone()
    got = rope_cache_attention(qkv, cos, ssin, cache, slots, qo, kv_ptr, kv_idx, last, 6, 0.25)
    want = rope_cache_attention_ref(qkv, cos, ssin, ref_cache, slots, qo, kv_ptr, kv_idx, last, 6, 0.25)
    assert got.shape == (qkv.shape[0], 6 * 16) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the new K/V rows are written where the reference writes them (K rotated in qkv's dtype: one rounding)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=tol, atol=tol)


def test_rope_cache_attention_rejects_a_qkv_of_the_wrong_width() -> None:
    qkv, cos, ssin, cache, slots, qo, kv_ptr, kv_idx, last = case(torch.float32, [3], [1])
    with pytest.raises(RuntimeError, match="qkv"):
        rope_cache_attention(qkv[:, :-16], cos, ssin, cache, slots, qo, kv_ptr, kv_idx, last, 6, 0.25)
