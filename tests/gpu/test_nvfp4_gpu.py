"""The NVFP4 Triton kernels compiled on a CUDA device (bf16 dot operands) against the float64
dequantize-then-matmul reference, on Qwen3-8B's and Qwen3.6-27B's linear shapes: the W4A16
kernel with its chosen tiles and split-K (reduced in the kernel), the dequantize path of the
dispatch, determinism, counter reset across launches, and CUDA-graph capture."""

import pytest
import torch

from bench.kernels import QWEN3_8B_SHAPES, QWEN36_27B_SHAPES
from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, fuse_nvfp4, quantize_nvfp4
from kernels.nvfp4_matmul import NVFP4Linear, matmul_path, nvfp4_linear, nvfp4_linear_ref, select_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from kernels import nvfp4_dequant, nvfp4_triton, nvfp4_w4a16

REAL_SHAPES = sorted({*QWEN3_8B_SHAPES.values(), *QWEN36_27B_SHAPES.values()})


def make_weight(n: int, k: int, seed: int = 0, std: float = 0.05) -> NVFP4Weight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * std)


def make_x(m: int, k: int, seed: int = 1, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, generator=g, device="cuda") * scale).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def layout_of(w: NVFP4Weight) -> "nvfp4_triton.KernelLayout":
    return nvfp4_triton.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, w: NVFP4Weight, slices: int) -> None:
    """bf16 x and the decoded weights are exact dot operands, their products exact in fp32: what
    is left is fp32 accumulation (K + slices + 4 roundings, see tests/kernels/test_nvfp4_matmul.py), each
    taken as a whole fp32 ulp since tensor cores may truncate partial sums rather than round, and
    the cast of the result to bf16 (half an ulp; a whole one allowed)."""
    want = nvfp4_linear_ref(x.double(), w)
    magnitude = x.double().abs() @ dequantize_nvfp4(w, torch.float64).abs().T
    bound = (x.shape[1] + slices + 4) * 2.0**-23 * magnitude + 2.0**-8 * want.abs()
    excess = (got.double() - want).abs() - bound
    assert excess.max().item() <= 0.0, f"worst excess {excess.max().item():.3g}"


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize(("n", "k"), REAL_SHAPES)
def test_decode_kernel_on_real_shapes_is_within_rounding(m: int, n: int, k: int) -> None:
    w, x = make_weight(n, k, seed=m), make_x(m, k, seed=n)
    layout = layout_of(w)
    got = nvfp4_w4a16.w4a16_matmul(x, layout)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert_within_rounding(got, x, w, nvfp4_w4a16.choose_config(m, n, k, num_sms).split_k)
    torch.cuda.synchronize()
    assert not layout.tile_locks.any(), "split-K counters must be back at zero"


@pytest.mark.parametrize("m", [33, 64, 130, 256])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 12288), (34816, 5120)])
def test_dispatch_at_batch_and_prefill_sizes_matches_reference(m: int, n: int, k: int) -> None:
    w, x = make_weight(n, k, seed=m), make_x(m, k, seed=n)
    got = nvfp4_linear(x, w)
    assert relative_error(got, nvfp4_linear_ref(x.double(), w)) <= 1e-2
    assert matmul_path(m) == ("dequant" if m >= 128 else "w4a16")


@pytest.mark.parametrize(
    "config",
    [
        (16, 64, 1, 4),
        (16, 128, 4, 4),
        (16, 64, 8, 2),
        (32, 64, 3, 8),
        (64, 64, 2, 4),
        (128, 128, 1, 2),
        (128, 128, 3, 2),
    ],
)
@pytest.mark.parametrize("lanes", [False, True], ids=["joined", "lanes"])
def test_every_tile_shape_and_split_matches_reference(config: tuple[int, int, int, int], lanes: bool) -> None:
    block_m, block_n, split_k, halves = config
    w, x = make_weight(1000, 2000, seed=split_k), make_x(37, 2000, seed=block_n)  # ragged N, M and K
    cfg = nvfp4_w4a16.W4A16Config(block_m, block_n, split_k, halves, num_warps=8 if block_m >= 128 else 4, lanes=lanes)
    got = nvfp4_w4a16.w4a16_matmul(x, layout_of(w), config=cfg)
    assert_within_rounding(got, x, w, split_k)


@pytest.mark.parametrize(("n", "k"), [(1000, 2000), (34816, 5120)])
def test_dequantize_kernel_is_bit_exact_in_bf16(n: int, k: int) -> None:
    shards = [make_weight(n // 2, k, seed=1, std=1.0), make_weight(n // 2, k, seed=2, std=1e-3)]
    w = fuse_nvfp4(shards)
    assert torch.equal(nvfp4_dequant.dequantize_layout(layout_of(w)), dequantize_nvfp4(w, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [9, 160])
def test_activation_dtypes(dtype: torch.dtype, m: int) -> None:
    w, x = make_weight(256, 512, seed=2), make_x(m, 512, seed=3, dtype=dtype)
    got = nvfp4_linear(x, w)
    assert got.dtype == dtype
    assert relative_error(got, nvfp4_linear_ref(x.double(), w)) <= 1e-2


def test_large_bf16_activations_do_not_overflow() -> None:
    """bf16 activations take bf16 dot operands, so values past fp16's 65504 stay finite."""
    w, x = make_weight(128, 256, seed=4, std=1.0), make_x(4, 256, seed=5, scale=1e5)
    got = nvfp4_linear(x, w)
    assert torch.isfinite(got).all()
    assert relative_error(got, nvfp4_linear_ref(x.double(), w)) <= 1e-2


def test_fused_shards_keep_their_scales() -> None:
    shards = [
        make_weight(512, 1024, seed=6, std=1.0),
        make_weight(128, 1024, seed=7, std=1e-3),
        make_weight(128, 1024, seed=8, std=0.05),
    ]
    x = make_x(5, 1024, seed=9)
    got = nvfp4_linear(x, fuse_nvfp4(shards))
    for (start, stop), shard in zip([(0, 512), (512, 640), (640, 768)], shards):
        assert relative_error(got[:, start:stop], nvfp4_linear_ref(x.double(), shard)) <= 1e-2


def test_bias_with_split_k() -> None:
    w, x = make_weight(256, 4096, seed=10), make_x(2, 4096, seed=11)
    bias = torch.linspace(-1.0, 1.0, 256, device="cuda", dtype=torch.bfloat16)
    cfg = nvfp4_w4a16.W4A16Config(16, 64, split_k=8)
    got = nvfp4_w4a16.w4a16_matmul(x, layout_of(w), bias, config=cfg)
    assert relative_error(got, nvfp4_linear_ref(x.double(), w, bias.double())) <= 1e-2


def test_split_k_is_bitwise_reproducible_over_many_launches() -> None:
    """The counters reset themselves: launch after launch, the last slice of each tile reduces."""
    w, x = make_weight(4096, 4096, seed=12), make_x(8, 4096, seed=13)
    layout = layout_of(w)
    assert (
        nvfp4_w4a16.choose_config(8, 4096, 4096, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    )
    first = nvfp4_w4a16.w4a16_matmul(x, layout)
    outs = [nvfp4_w4a16.w4a16_matmul(x, layout) for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    assert not layout.tile_locks.any()


def test_module_uses_the_device_backend_and_no_dequantized_copy() -> None:
    w = make_weight(1024, 2048, seed=14)
    layer = NVFP4Linear(w)
    major, _ = torch.cuda.get_device_capability()
    assert layer.backend == select_backend(w.device) or layer.backend == "triton"
    if major == 9:
        assert layer.backend == "triton"
    assert layer.weight_nbytes <= w.nbytes + 4 * 1024
    x = make_x(3, 2048, seed=15).reshape(1, 3, 2048)
    assert relative_error(layer(x).reshape(3, 1024), nvfp4_linear_ref(x.reshape(3, 2048).double(), w)) <= 1e-2


@pytest.mark.parametrize("m", [4, 256])  # split-K kernel; dequantize + cuBLAS
def test_cuda_graph_replay_matches_eager(m: int) -> None:
    layer = NVFP4Linear(make_weight(4096, 4096, seed=16))
    static_x = make_x(m, 4096, seed=17)
    eager = layer(static_x)  # also compiles the kernel outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in (18, 19):
        static_x.copy_(make_x(m, 4096, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(static_x))
    assert not torch.equal(static_out, eager)
