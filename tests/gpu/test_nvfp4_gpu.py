"""The NVFP4 W4A16 Triton kernel compiled on a CUDA device (bf16 dot operands) against the
float64 dequantize-then-matmul reference; dispatch, determinism and CUDA-graph capture."""

import pytest
import torch

from kernels.nvfp4 import NVFP4Weight, fuse_nvfp4, quantize_nvfp4
from kernels.nvfp4_matmul import NVFP4Linear, nvfp4_linear, nvfp4_linear_ref, select_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from kernels import nvfp4_triton


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


@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 256])
@pytest.mark.parametrize(("n", "k"), [(48, 80), (4096, 4096), (6144, 4096), (4096, 12288), (100, 1000 // 16 * 16)])
def test_kernel_matches_reference_with_chosen_tiles(m: int, n: int, k: int) -> None:
    w, x = make_weight(n, k, seed=m), make_x(m, k, seed=n)
    got = nvfp4_triton.w4a16_matmul(x, layout_of(w))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert relative_error(got, nvfp4_linear_ref(x.double(), w)) <= 1e-2


@pytest.mark.parametrize("config", [(16, 64, 1), (16, 128, 4), (16, 256, 8), (32, 128, 3), (64, 64, 2), (128, 128, 1)])
def test_every_tile_shape_and_split_matches_reference(config: tuple[int, int, int]) -> None:
    block_m, block_n, split_k = config
    w, x = make_weight(1000, 2000, seed=split_k), make_x(37, 2000, seed=block_n)
    cfg = nvfp4_triton.W4A16Config(block_m, block_n, split_k, num_warps=8 if block_m >= 128 else 4)
    got = nvfp4_triton.w4a16_matmul(x, layout_of(w), config=cfg)
    assert relative_error(got, nvfp4_linear_ref(x.double(), w)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_dtypes(dtype: torch.dtype) -> None:
    w, x = make_weight(256, 512, seed=2), make_x(9, 512, seed=3, dtype=dtype)
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
    shards = [make_weight(512, 1024, seed=6, std=1.0), make_weight(128, 1024, seed=7, std=1e-3),
              make_weight(128, 1024, seed=8, std=0.05)]
    x = make_x(5, 1024, seed=9)
    got = nvfp4_linear(x, fuse_nvfp4(shards))
    for (start, stop), shard in zip([(0, 512), (512, 640), (640, 768)], shards):
        assert relative_error(got[:, start:stop], nvfp4_linear_ref(x.double(), shard)) <= 1e-2


def test_bias_with_split_k() -> None:
    w, x = make_weight(256, 4096, seed=10), make_x(2, 4096, seed=11)
    bias = torch.linspace(-1.0, 1.0, 256, device="cuda", dtype=torch.bfloat16)
    cfg = nvfp4_triton.W4A16Config(16, 64, split_k=8)
    got = nvfp4_triton.w4a16_matmul(x, layout_of(w), bias, config=cfg)
    assert relative_error(got, nvfp4_linear_ref(x.double(), w, bias.double())) <= 1e-2


def test_split_k_results_are_bitwise_reproducible() -> None:
    w, x = make_weight(4096, 4096, seed=12), make_x(8, 4096, seed=13)
    layout = layout_of(w)
    first = nvfp4_triton.w4a16_matmul(x, layout)
    assert nvfp4_triton.choose_config(8, 4096, 4096, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    for _ in range(3):
        assert torch.equal(nvfp4_triton.w4a16_matmul(x, layout), first)


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


def test_cuda_graph_replay_matches_eager() -> None:
    layer = NVFP4Linear(make_weight(4096, 4096, seed=16))
    static_x = make_x(4, 4096, seed=17)
    eager = layer(static_x)  # also compiles the kernel outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_x.copy_(make_x(4, 4096, seed=18))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, layer(static_x))
    assert not torch.equal(static_out, eager)
