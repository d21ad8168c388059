"""Block-FP8 W8A8 on a CUDA device with FP8 tensor cores (SM89+): the Triton GEMM and fused MoE
compiled for the device against their torch references at Qwen3.6-27B's and Qwen3-Coder-30B-A3B's
shapes, and an FP8 checkpoint kept in FP8 at load agreeing with its dequantized self.
NOTE: written without a GPU; these have never run (docs/gpu.md)."""

from pathlib import Path

import pytest
import torch

from engine.weights import loader
from kernels.fp8_block import Fp8BlockWeight, fp8_device_supported, quantize_block_fp8, w8a8_block_matmul_ref
from kernels.fp8_dispatch import Fp8Experts, Fp8Linear
from kernels.fused_moe import route
from kernels.fused_moe_fp8 import Fp8ExpertWeights, fused_experts_fp8_ref
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import capture_logits, make_engine
from tests.factories import make_moe_checkpoint
from tests.fp8_factory import to_fp8_checkpoint

CUDA = torch.device("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_device_supported(CUDA),
        reason="needs a CUDA device with FP8 tensor cores (SM89+)",
    ),
]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def weight(n: int, k: int, seed: int = 0) -> Fp8BlockWeight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return Fp8BlockWeight(*quantize_block_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.02), 128, 128)


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(5120 * 2, 5120), (5120, 17408)])
def test_gemm_matches_reference(m: int, n: int, k: int) -> None:
    w = weight(n, k)
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = Fp8Linear(w)(x)  # dispatch: the Triton kernel on SM89+
    want = w8a8_block_matmul_ref(x.float(), w)
    assert got.dtype == torch.bfloat16 and relative_error(got, want) <= 1e-2


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_fp8_experts_match_reference(t: int) -> None:
    e, h, i = 128, 2048, 768
    w13 = Fp8ExpertWeights.stack([[weight(2 * i, h, seed=x)] for x in range(e)])
    w2 = Fp8ExpertWeights.stack([[weight(h, i, seed=1000 + x)] for x in range(e)])
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
    weights, ids = route(x, torch.randn(e, h, generator=g, device="cuda"), 8, True)
    got = Fp8Experts(w13, w2)(x, weights, ids)
    want = fused_experts_fp8_ref(x.float(), w13, w2, weights, ids)
    assert relative_error(got, want) <= 2e-2


@pytest.mark.timeout(90)
def test_kept_fp8_checkpoint_agrees_with_its_dequantized_self(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on CUDA keeps the linears and experts FP8 (W8A8); its first-token logits stay
    within W8A8's error of the same checkpoint dequantized at load (float32), on the same device.
    NOTE: the reference runs on the GPU, not the CPU: a CPU engine compiles the C++ CPU ops into a
    cold cache first (engine/host/cpu_kernels.py), which on a fresh GPU machine outlasts the budget."""
    fp8 = to_fp8_checkpoint(
        make_moe_checkpoint(
            tmp_path / "f", hidden_size=256, moe_intermediate_size=128, intermediate_size=256, head_dim=64
        ),
        tmp_path / "fp8",
    )
    prompt = [list(range(3, 40))]
    kept = make_engine(fp8, device="cuda", dtype="bfloat16", attention_backend="torch", enforce_eager=True)
    model = kept.core.runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    got = capture_logits(kept)
    kept.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    monkeypatch.setattr(loader, "keeps_fp8", lambda *args, **kwargs: False)  # dequantize as it streams in
    dequantized = make_engine(fp8, device="cuda", dtype="float32", attention_backend="torch", enforce_eager=True)
    assert not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in dequantized.core.runner.model.modules())
    want = capture_logits(dequantized)
    dequantized.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    [a], [b] = list(got.values()), list(want.values())
    assert relative_error(a[0].float(), b[0].float()) < 5e-2
