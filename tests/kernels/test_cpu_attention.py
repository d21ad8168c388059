"""The CPU paged-attention ops (kernels/cpu_attention.cpp) against their torch references, and the
`cpu` attention backend against the torch reference backend on the batches the engine builds:
decodes, short and long prefill chunks in one step, GQA, bf16/float32 activations and caches."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_paged import OP_MAX_QUERY_ROWS, CpuAttentionBackend
from engine.attention.select import choose_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch
from engine.errors import ConfigError
from engine.host.cpu_kernels import load_cpu_ops
from kernels.cpu_attention import paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref

CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


def make_batch(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_pages: int, seed: int = 0
) -> ForwardBatch:
    """Requests with shuffled pages; each request's new tokens are its last `query_len` positions."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_pages, generator=g).tolist()
    qo, kv_ptr, kv_idx, last, slots, positions = [0], [0], [], [], [], []
    for q_len, seq_len in zip(query_lens, seq_lens):
        n = -(-seq_len // block_size)
        pages, free = free[:n], free[n:]
        kv_idx += pages
        kv_ptr.append(len(kv_idx))
        last.append(seq_len - (n - 1) * block_size)
        qo.append(qo[-1] + q_len)
        for p in range(seq_len - q_len, seq_len):
            slots.append(pages[p // block_size] * block_size + p % block_size)
            positions.append(p)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ids = [str(i) for i in range(len(query_lens))]
    return ForwardBatch(
        input_ids=torch.zeros(qo[-1], dtype=torch.int64),
        positions=torch.tensor(positions),
        qo_indptr=i32(qo),
        kv_indptr=i32(kv_ptr),
        kv_indices=i32(kv_idx),
        kv_last_page_len=i32(last),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(qo[1:]) - 1,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_size=block_size,
        request_ids=ids,
        sample_request_ids=ids,
    )


BATCHES = {
    "one decode": ([1], [1]),
    "decodes of mixed lengths": ([1, 1, 1, 1], [37, 16, 1, 100]),
    "decodes and short chunks": ([1, 5, 3, 1], [20, 5, 48, 17]),
    "verify rows": ([4, 4], [30, 9]),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize(
    "dtypes",
    [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32), (F16, F16)],
    ids=["f32", "bf16", "f32-q_bf16-cache", "bf16-q_f32-cache", "f16"],
)
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (6, 6)], ids=["gqa2", "gqa3", "mha"])
def test_paged_attention_equals_the_reference(
    name: str, dtypes: tuple[torch.dtype, torch.dtype], heads: tuple[int, int]
) -> None:
    query_lens, seq_lens = BATCHES[name]
    q_dtype, cache_dtype = dtypes
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(len(seq_lens))
    batch = make_batch(query_lens, seq_lens, block_size=16, num_pages=24)
    cache = torch.randn(24, 2, 16, num_kv_heads, 64, generator=g).to(cache_dtype)
    q = torch.randn(batch.num_tokens, num_heads, 64, generator=g).to(q_dtype)
    meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    out = paged_attention(q, cache, *meta, 0.125)
    ref = paged_attention_ref(q, cache, *meta, 0.125)
    assert out.dtype == q_dtype and out.shape == q.shape
    tol = 2e-6 if q_dtype == F32 else 2**-7  # float32 accumulation either way; bf16/f16 output rounding
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_paged_attention_reads_strided_query_rows_and_head_dims_off_the_vector_width() -> None:
    """q as a view into a fused q/k tensor (rows longer than Hq * D), head_dim 40 (not a multiple
    of the vector width), a long context over many pages: the parallel path."""
    g = torch.Generator().manual_seed(5)
    batch = make_batch([1] * 8, [700, 3, 64, 65, 900, 1, 17, 512], block_size=16, num_pages=200)
    qk = torch.randn(batch.num_tokens, 12, 40, generator=g)
    q = qk[:, :8]  # [T, 8, 40], row stride 12 * 40
    cache = torch.randn(200, 2, 16, 4, 40, generator=g)
    meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    torch.testing.assert_close(
        paged_attention(q, cache, *meta, 0.3), paged_attention_ref(q, cache, *meta, 0.3), rtol=2e-6, atol=2e-6
    )


@pytest.mark.parametrize(
    "shape",
    [(8, 8, 64, 16), (16, 2, 128, 16), (24, 4, 256, 16), (12, 2, 64, 32), (10, 2, 48, 8)],
    ids=["mha-d64", "gqa8-d128", "gqa6-d256", "gqa6-d64-bs32", "gqa5-d48-bs8"],
)
@pytest.mark.parametrize("rows", ["batch", "few rows"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_paged_attention_over_head_groups_widths_and_page_sizes_on_two_threads(
    shape: tuple[int, int, int, int], rows: str, dtype: torch.dtype
) -> None:
    """The op's compile-time shapes (head blocks of 1-4 query heads, head_dim 64/128/256 in
    registers, 48 through the runtime loops), page sizes other than 16, and both ways of sharing
    the rows between threads: a decode batch with a prefill chunk (a row per work item) and two
    long rows (their KV heads split over the threads)."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    if rows == "batch":
        query_lens, seq_lens = [1] * 20 + [7], [1 + 37 * i % 300 for i in range(20)] + [90]
    else:
        query_lens, seq_lens = [1, 1], [1000, 700]
    num_pages = sum(-(-n // block_size) for n in seq_lens) + 3
    g = torch.Generator().manual_seed(head_dim + block_size)
    batch = make_batch(query_lens, seq_lens, block_size=block_size, num_pages=num_pages)
    cache = torch.randn(num_pages, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=g).to(dtype)
    meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = paged_attention(q, cache, *meta, head_dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    ref = paged_attention_ref(q, cache, *meta, head_dim**-0.5)
    tol = 2e-6 if dtype == F32 else 2**-7
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)])
def test_reshape_and_cache_writes_exactly_what_index_copy_writes(dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    src_dtype, cache_dtype = dtypes
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(8, 2, 4, 3, 16, generator=g).to(cache_dtype)
    kv = torch.randn(2, 5, 6, 16, generator=g)
    k, v = kv[0, :, :3].to(src_dtype), kv[1, :, 3:].to(src_dtype)  # views with a longer row stride
    slots = torch.tensor([0, 5, 31, 12, 13])
    ours, theirs = cache.clone(), cache.clone()
    reshape_and_cache(k, v, ours, slots)
    reshape_and_cache_ref(k, v, theirs, slots)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, cache)


def test_the_ops_reject_what_they_cannot_read() -> None:
    batch = make_batch([1], [4], block_size=4, num_pages=2)
    cache = torch.zeros(2, 2, 4, 2, 8)
    meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    with pytest.raises(RuntimeError, match="head_dim do not match"):
        paged_attention(torch.zeros(1, 4, 16), cache, *meta, 1.0)
    with pytest.raises(RuntimeError, match="int32 contiguous metadata"):
        paged_attention(torch.zeros(1, 4, 8), cache, batch.qo_indptr.long(), *meta[1:], 1.0)
    with pytest.raises(RuntimeError, match="is not built"):
        paged_attention(torch.zeros(1, 4, 8, dtype=F16), cache, *meta, 1.0)
    with pytest.raises(RuntimeError, match="one slot per row"):
        reshape_and_cache(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), cache, torch.tensor([0]))


def run_backend(
    backend: CpuAttentionBackend | TorchAttentionBackend,
    batch: ForwardBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
) -> torch.Tensor:
    backend.plan(batch)
    return backend.forward(q, k, v, cache)


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([1, 1, 1], [9, 40, 2]),  # pure decode: the op over the batch's own metadata
        ([1, OP_MAX_QUERY_ROWS, 1], [30, OP_MAX_QUERY_ROWS, 7]),  # a chunk at the op's limit
        ([1, 40, 3, 1, 25], [12, 40, 50, 33, 60]),  # long chunks through SDPA, the rest through the op
        ([40], [56]),  # one long chunk after 16 cached tokens
    ],
)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_cpu_backend_attends_like_the_torch_backend(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(sum(seq_lens))
    batch = make_batch(query_lens, seq_lens, block_size=8, num_pages=64)
    q = torch.randn(batch.num_tokens, 6, 32, generator=g).to(dtype)
    k, v = (torch.randn(batch.num_tokens, 2, 32, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(64, 2, 8, 2, 32, generator=g).to(dtype)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    ours = run_backend(CpuAttentionBackend(6, 2, 32, CPU), batch, q, k, v, ours_cache)
    ref = run_backend(TorchAttentionBackend(6, 2, 32, CPU), batch, q, k, v, ref_cache)
    assert torch.equal(ours_cache, ref_cache)  # every new K/V written, before any is read
    tol = 2e-6 if dtype == F32 else 2**-6
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)


def test_auto_picks_the_cpu_backend_where_it_covers_the_dtypes() -> None:
    assert choose_backend("auto", CPU, False, dtype=BF16, head_dim=64) == "cpu"
    assert choose_backend("auto", CPU, False, dtype=F32, head_dim=64, kv_dtype=BF16) == "cpu"
    assert choose_backend("auto", CPU, False, dtype=F16, head_dim=64, kv_dtype=BF16) == "torch"  # not built
    assert choose_backend("torch", CPU, False, dtype=BF16) == "torch"
    with pytest.raises(ConfigError, match="--attention-backend cpu: do not cover float16 activations"):
        choose_backend("cpu", CPU, False, dtype=F16, kv_dtype=BF16)
    with pytest.raises(ConfigError, match="--attention-backend cpu: needs --device cpu"):
        choose_backend("cpu", torch.device("cuda"), False, dtype=BF16)
