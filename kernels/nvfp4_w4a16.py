"""The NVFP4 W4A16 matmul on the GPU: y[M, N] = x[M, K] @ W[N, K]^T + b, W in `KernelLayout`
(E2M1 codes and E4M3 block scales, dequantized in registers), one launch per call. Its tile and
split heuristic, a function of (M, N, K, SM count), lives here too. Reference:
`kernels.nvfp4_matmul.nvfp4_linear_ref`.

Design, for decode sizes (M <= 64), where the weight stream is the whole cost:
- Every SM streams. Small weight-row tiles (BLOCK_N = 64) and split-K until there are at least
  two CTAs per SM: Qwen3-8B's o projection (N = K = 4096) has 64 row tiles, so one CTA per tile
  would leave half of an H200's 132 SMs idle and the rest latency-bound.
- Wide loads, several in flight. Each K step reads 256 K (128 bytes of codes per row: whole
  cache lines, 128-bit vector loads) and the loop is software-pipelined (num_stages), so each
  warp has several lines in flight, where the first kernel read 32-byte row segments.
- Few, large dots. The layout's shift-and-mask decode yields, for each of the four group
  positions q, a [BLOCK_N, 4 * 16] slab of weights for four scale groups at once; one dot of
  K = 64 per q (K-order permuted consistently on both sides: a dot only sums over K) replaces
  eight K = 16 dots per 128 K. W is the dot's left side ("swap AB"): M <= 16 tokens fill a
  16-wide tile instead of padding a 64-row MMA. A variant (`lanes`) splits each slab into its
  even-j and odd-j weights, two dots of K = 32, so that the decode is elementwise from the loads
  with no join/reshape; which of the two the compiler turns into fewer shared-memory round trips
  is for the device's `bench.kernels --sweep` to say.
- One launch. The K slices are reduced inside the kernel ("serial split-K"): each slice writes
  its fp32 partial tile to a workspace and bumps a per-tile counter; the last to arrive sums the
  slices in a fixed order (bit-reproducible, unlike fp32 atomics into the output), applies the
  per-row global scale and bias, writes x.dtype and resets the counter for the next launch. The
  first kernel spent two more launches (a sum and a cast) on that.
Prefill sizes use 128-token tiles or, past a threshold, dequantize + cuBLAS
(`kernels.nvfp4_matmul.matmul_path`)."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.nvfp4_triton import CHUNK_K, KernelLayout, default_dot_dtype, tl_dtype

# NOTE: core builtins only in the kernels (see the NOTE in kernels.nvfp4_triton), so that
# reloading this module with TRITON_INTERPRET=1 set interprets them.

HALF_CHUNK_K = CHUNK_K // 2  # K of one half chunk: 8 words per row, four scale groups
CTAS_PER_SM = 2  # decode launches aim for at least this many CTAs per SM


@dataclass(frozen=True)
class W4A16Config:
    """Tile and launch parameters of `w4a16_matmul`."""

    block_m: int  # tokens per tile, a power of two >= 16
    block_n: int  # weight rows per tile, a power of two >= 16
    split_k: int = 1  # K slices; > 1 reduces them in the kernel (serial split-K)
    halves: int = 4  # half chunks (64 K each) per K step, a power of two >= 2: K step = 64 * halves
    num_warps: int = 4
    num_stages: int = 4
    lanes: bool = False  # two dots per group position (even j, odd j) instead of one joined dot

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            assert size >= 16 and size & (size - 1) == 0, f"{name}={size} must be a power of two >= 16"
        # >= 2: whole 128-K chunks per step (the layout's unit), and no size-1 aranges.
        assert self.halves >= 2 and self.halves & (self.halves - 1) == 0, f"halves={self.halves}"
        assert self.split_k >= 1, f"split_k={self.split_k}"

    @property
    def block_k(self) -> int:
        return HALF_CHUNK_K * self.halves

    def describe(self) -> str:
        return (
            f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} "
            f"w{self.num_warps} st{self.num_stages}" + (" lanes" if self.lanes else "")
        )


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slices, K per slice) for a requested split: whole K steps per slice, no empty slice."""
    steps = triton.cdiv(k, block_k)
    steps_per_split = triton.cdiv(steps, min(split_k, steps))
    return triton.cdiv(steps, steps_per_split), steps_per_split * block_k


def choose_config(m: int, n: int, k: int, num_sms: int) -> W4A16Config:
    """Tiles by batch size, then the smallest split-K that gives CTAS_PER_SM CTAs per SM.

    The split is capped twice: each slice keeps at least two K steps (something for the
    pipeline to overlap), and the fp32 partial tiles (written and read back: 8 bytes per
    output per slice, mostly in L2) stay under the weight bytes (9/16 byte per element), which
    stops splitting at prefill sizes."""
    if m <= 16:
        block_m, block_n, halves, warps, stages = 16, 64, 4, 4, 4
    elif m <= 64:
        block_m, block_n, halves, warps, stages = triton.next_power_of_2(m), 64, 4, 4, 3
    else:
        # Half-height weight tiles where 128 x 128 tiles would not give each SM one CTA.
        wide = triton.cdiv(n, 128) * triton.cdiv(m, 128) >= num_sms
        block_m, block_n, halves, warps, stages = 128, 128 if wide else 64, 2, 8, 3
    block_k = HALF_CHUNK_K * halves
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    steps = triton.cdiv(k, block_k)
    max_split = max(1, min(steps // 2, (9 * k) // (16 * 8 * m)))
    split_k = 1
    # Whole K steps per slice: asking for 5 slices of 16 steps gives 4, so count what results.
    while tiles * effective_split(k, block_k, split_k)[0] < CTAS_PER_SM * num_sms and split_k < max_split:
        split_k += 1
    split_k = effective_split(k, block_k, split_k)[0]
    return W4A16Config(block_m, block_n, split_k, halves=halves, num_warps=warps, num_stages=stages)


def num_ctas(m: int, n: int, k: int, config: W4A16Config) -> int:
    """CTAs one launch runs with `config` (what the SM-occupancy tests check)."""
    slices, _ = effective_split(k, config.block_k, config.split_k)
    return triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m) * slices


@triton.jit
def _decode_slab(words, scales, q: tl.constexpr, BLOCK_N: tl.constexpr, HALVES: tl.constexpr):
    """[BLOCK_N, HALVES * 16] fp16 weights * 2**-14 of scale group q of each half chunk, K-order
    (half, j), from words [BLOCK_N, HALVES, 8] uint32 and scales [BLOCK_N, HALVES] int32."""
    shifted = words << (4 * q)
    pair = (shifted & 0x80008000) | ((shifted >> 3) & 0x0E000E00)  # two fp16: j even, j odd
    bits = tl.join((pair & 0xFFFF).to(tl.uint16), (pair >> 16).to(tl.uint16))  # [BLOCK_N, HALVES, 8, 2]
    # e4m3 bits << 7 are fp16 bits worth sf * 2**-8; sf itself is exact in fp16.
    scale_bits = ((scales >> (8 * q)) & 0xFF).to(tl.uint16) << 7
    scale = (scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(tl.float16)
    # e2m1 * 2**-14 * sf: <= 6 significant bits, <= 0.17: exact in fp16 and bf16.
    weights = bits.to(tl.float16, bitcast=True) * scale[:, :, None, None]
    return weights.reshape(BLOCK_N, HALVES * 16)


@triton.jit
def _step_joined(
    acc,
    x_ptr,
    w_ptr,
    s_ptr,
    offs_n,
    offs_m,
    n_ok,
    m_ok,
    k0,
    K,
    k_pad,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    HALVES: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One K step (64 * HALVES), each group position's slab joined into one dot of K = 16 * HALVES."""
    offs_h = tl.arange(0, HALVES)
    offs_t = tl.arange(0, HALVES * 16)  # (half, j) of one slab
    half0 = k0 // 64
    if EVEN_K:
        h_ok = n_ok[:, None] & (offs_h >= 0)[None, :]
    else:
        h_ok = n_ok[:, None] & (half0 + offs_h < k_pad // 64)[None, :]
    # [BLOCK_N, HALVES, 8] words: HALVES * 32 contiguous bytes per row.
    words = tl.load(
        w_ptr
        + offs_n[:, None, None] * stride_wn
        + (half0 + offs_h)[None, :, None] * 8
        + tl.arange(0, 8)[None, None, :],
        mask=h_ok[:, :, None],
        other=0,
    ).to(tl.uint32, bitcast=True)
    # [BLOCK_N, HALVES] int32: the four e4m3 block scales of each half chunk.
    scales = tl.load(s_ptr + offs_n[:, None] * stride_sn + (half0 + offs_h)[None, :], mask=h_ok, other=0)
    for q in tl.static_range(4):
        w = _decode_slab(words, scales, q, BLOCK_N, HALVES)
        # Slab element t is K offset 64 (t // 16) + 16 q + t % 16 of the step.
        offs_k = k0 + 16 * q + (offs_t // 16) * 64 + offs_t % 16
        if EVEN_K:
            x_ok = m_ok[None, :]
        else:
            x_ok = m_ok[None, :] & (offs_k < K)[:, None]
        # [HALVES * 16, BLOCK_M] activations in the slab's K order, transposed: W is the left side.
        x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk, mask=x_ok, other=0.0)
        acc = tl.dot(w.to(DOT_DTYPE), x_t.to(DOT_DTYPE), acc)
    return acc


@triton.jit
def _step_lanes(
    acc,
    x_ptr,
    w_ptr,
    s_ptr,
    offs_n,
    offs_m,
    n_ok,
    m_ok,
    k0,
    K,
    k_pad,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    HALVES: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One K step like `_step_joined`, but the even-j and odd-j weights of a slab go to two dots of
    K = 8 * HALVES: no join or reshape, so the decode is elementwise from the loads (the compiler
    may then decode in the dot operand's register layout instead of converting through shared
    memory). Each scale word is loaded for each of its 8 word columns (L1 hits) for the same reason."""
    offs_c = tl.arange(0, HALVES * 8)  # (half, j // 2)
    half = k0 // 64 + offs_c // 8
    if EVEN_K:
        c_ok = n_ok[:, None] & (offs_c >= 0)[None, :]
    else:
        c_ok = n_ok[:, None] & (half < k_pad // 64)[None, :]
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + offs_c)[None, :], mask=c_ok, other=0).to(
        tl.uint32, bitcast=True
    )  # [BLOCK_N, HALVES * 8]
    scales = tl.load(s_ptr + offs_n[:, None] * stride_sn + half[None, :], mask=c_ok, other=0)  # [BLOCK_N, HALVES * 8]
    pair_k = (offs_c // 8) * 64 + (offs_c % 8) * 2  # K offset of each column's even-j weight, less 16 q
    for q in tl.static_range(4):
        shifted = words << (4 * q)
        pair = (shifted & 0x80008000) | ((shifted >> 3) & 0x0E000E00)
        scale_bits = ((scales >> (8 * q)) & 0xFF).to(tl.uint16) << 7
        scale = (scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(tl.float16)
        offs_k = k0 + 16 * q + pair_k
        if EVEN_K:
            x_ok = m_ok[None, :]
        else:
            x_ok = m_ok[None, :] & (offs_k < K)[:, None]  # K is a multiple of 16: the odd partner too
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk  # [HALVES * 8, BLOCK_M]
        for lane in tl.static_range(2):
            w = ((pair >> (16 * lane)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) * scale
            x_t = tl.load(x_ptrs + lane * stride_xk, mask=x_ok, other=0.0)
            acc = tl.dot(w.to(DOT_DTYPE), x_t.to(DOT_DTYPE), acc)
    return acc


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    k_pad,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALVES: tl.constexpr,
    LANES: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    # A fixed trip count: the last slice may run past k_pad, where nothing is loaded.
    for step in range(0, k_per_split, 64 * HALVES):
        k0 = pid_k * k_per_split + step
        if LANES:
            acc = _step_lanes(
                acc,
                x_ptr,
                w_ptr,
                s_ptr,
                offs_n,
                offs_m,
                n_ok,
                m_ok,
                k0,
                K,
                k_pad,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_sn,
                HALVES,
                EVEN_K,
                DOT_DTYPE,
            )
        else:
            acc = _step_joined(
                acc,
                x_ptr,
                w_ptr,
                s_ptr,
                offs_n,
                offs_m,
                n_ok,
                m_ok,
                k0,
                K,
                k_pad,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_sn,
                BLOCK_N,
                HALVES,
                EVEN_K,
                DOT_DTYPE,
            )

    tile_ok = n_ok[:, None] & m_ok[None, :]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
    if SPLIT:
        # Workspace [slices, M, N] fp32. The barrier orders every thread's stores before the one
        # thread that does the (acquire-release, GPU-scope) counter bump.
        partials = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(partials + pid_k * M * N, acc, mask=tile_ok)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        slices = tl.num_programs(2)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == slices - 1:
            # .cg: read the other CTAs' partials from L2, never from a stale L1 line.
            total = tl.load(partials, mask=tile_ok, other=0.0, cache_modifier=".cg")
            for s in range(1, slices):
                total += tl.load(partials + s * M * N, mask=tile_ok, other=0.0, cache_modifier=".cg")
            tl.store(lock_ptr + tile, 0)  # ready for the next launch (and CUDA-graph replay)
            total = total * 16384.0 / tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)[:, None]
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=tile_ok)
    else:
        acc = acc * 16384.0 / tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def w4a16_matmul(
    x: Tensor,
    weight: KernelLayout,
    bias: Tensor | None = None,
    *,
    dot_dtype: torch.dtype | None = None,
    config: W4A16Config | None = None,
) -> Tensor:
    """x [M, K] bf16/fp16/fp32, bias [N] | None -> [M, N] in x.dtype, in one kernel launch.
    Activations are rounded to the dot dtype in registers (fp32 ones lose precision there);
    accumulation is fp32."""
    m, k = x.shape
    n = weight.n
    assert k == weight.k, f"x has K={k}, weight has K={weight.k}"
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    assert weight.words.stride(1) == 1 and weight.scale_words.stride(1) == 1
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        config = choose_config(m, n, k, num_sms)
    k_pad = triton.cdiv(k, CHUNK_K) * CHUNK_K
    slices, k_per_split = effective_split(k_pad, config.block_k, config.split_k)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), slices)
    locks = weight.tile_locks
    if slices > 1 and (locks is None or grid[0] * grid[1] > locks.numel()):
        # No counters (a layout built without them), or more tiles than counters (only for M far
        # past where splitting pays): no split.
        slices, k_per_split = 1, triton.cdiv(k_pad, config.block_k) * config.block_k
        grid = grid[:2] + (1,)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    # [slices, M, N] fp32 partial sums, reduced in the kernel; unused without a split.
    workspace = torch.empty(slices, m, n, dtype=torch.float32, device=x.device) if slices > 1 else out
    _w4a16_kernel[grid](
        x,
        weight.words,
        weight.scale_words,
        weight.row_global_scale,
        bias if bias is not None else weight.row_global_scale,
        out,
        workspace,
        locks if slices > 1 else out,
        m,
        n,
        k,
        k_pad,
        k_per_split,
        x.stride(0),
        x.stride(1),
        weight.words.stride(0),
        weight.scale_words.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HALVES=config.halves,
        LANES=config.lanes,
        SPLIT=slices > 1,
        EVEN_K=k == slices * k_per_split,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=tl_dtype(dot_dtype or default_dot_dtype(x)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
