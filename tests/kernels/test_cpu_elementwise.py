"""The fused CPU elementwise ops (kernels/cpu_elementwise.cpp) against their torch references, and
the dense decoder with them switched on against the same model without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from engine.host.cpu_kernels import load_cpu_ops
from kernels.cpu_elementwise import (
    add_rms_norm,
    add_rms_norm_ref,
    argmax_rows,
    rms_norm,
    rms_norm_ref,
    rotary,
    rotary_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from scheduler.request import SamplingParams

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]
# float32: only the summation order differs; bf16/f16: one rounding of a float32 result, where a
# value near a rounding boundary may land one ulp away.
TOL = {F32: 2e-6, BF16: 2**-7, F16: 2**-10}


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[a.dtype], atol=TOL[a.dtype])


# (rows, hidden): decode sizes, a width off the vector width, and enough elements for the parallel path
SHAPES = [(1, 576), (5, 64), (3, 70), (300, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_and_add_rms_norm_equal_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x, residual = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.3 * torch.randn(shape[1], generator=g)).to(dtype)
    close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    total, normed = add_rms_norm(x, residual, weight, 1e-6)
    ref_total, ref_normed = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(total, ref_total)  # the sum rounds exactly as `residual + x` does
    close(normed, ref_normed)


def test_rms_norm_takes_strided_rows_of_any_leading_shape() -> None:
    """Qwen3's per-head q/k norms: a [T, H, D] view into the fused q/k/v rows."""
    qkv = torch.randn(4, 7, 16).to(BF16)
    q = qkv[:, :4]
    weight = torch.rand(16).to(BF16) + 0.5
    close(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (4, 2 * 40), (64, 2 * 1536)])
def test_silu_and_mul_equals_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))).to(dtype)
    close(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (7, 3, 16), (200, 12, 64)])
def test_rotary_equals_the_reference(dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2, head_dim, generator=g).to(dtype)
    qk = qkv[:, :heads]  # q and k heads of the fused rows, v left out
    cos, sin = (torch.randn(tokens, head_dim, generator=g).to(dtype) for _ in range(2))
    close(rotary(qk, cos, sin), rotary_ref(qk, cos, sin))


@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (3, 17), (5, 1000), (2, 1)])
def test_argmax_rows_equals_torch_argmax_with_ties_nan_and_infinities(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    rows, v = shape
    if v > 3:  # a tie (the first wins), a row of -inf, NaNs (the first NaN wins), +inf
        x[0, v // 3] = x[0, v - 1] = 1e4
        if rows > 1:
            x[1] = float("-inf")
        if rows > 2:
            x[2, v // 2] = x[2, v - 2] = float("nan")
        if rows > 3:
            x[3, v - 1] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(rows, v + 5, generator=g)[:, :v]  # rows longer than V
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))


def test_greedy_sampling_takes_the_argmax_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import device_sampling, sampler

    calls = []
    monkeypatch.setattr(device_sampling, "argmax_rows", lambda x: calls.append(x.shape) or argmax_rows(x))
    x = torch.randn(4, 300)
    assert torch.equal(sampler.greedy_ids(x), x.argmax(dim=-1)) and calls == [(4, 300)]
    assert torch.equal(sampler.greedy_ids(x.double()), x.double().argmax(dim=-1)) and len(calls) == 1


def test_the_ops_reject_what_they_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="weight \\[hidden\\] in x's dtype"):
        rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="an even last dimension"):
        silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="bfloat16, float16 or float32"):
        silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32 \\[B, V\\] with contiguous rows"):
        argmax_rows(torch.zeros(2, 8, dtype=BF16))


def first_logits(path: Path, dtype: str, fused: bool) -> tuple[list[int], torch.Tensor]:
    from tests.engine.test_engine_correctness import capture_logits

    e = OfflineEngine.from_config(EngineConfig(model=str(path), dtype=dtype, kv_cache_memory="4MiB"))
    model = e.core.runner.model
    assert model.cpu_ops and model.layers[0].mlp.cpu_ops and model.norm.cpu_ops, "the runner switches them on"
    if not fused:
        for m in model.modules():
            if hasattr(m, "cpu_ops"):
                m.cpu_ops = False
    seen = capture_logits(e)
    [result] = e.generate([[5, 17, 42, 99, 7, 300]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return result.token_ids[0], next(iter(seen.values()))[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decoder_with_fused_ops_matches_it_without(tmp_path: Path, arch: str, dtype: str) -> None:
    from tests.factories import make_checkpoint

    path = make_checkpoint(tmp_path / arch, arch)
    tokens, logits = first_logits(path, dtype, fused=True)
    ref_tokens, ref_logits = first_logits(path, dtype, fused=False)
    assert tokens == ref_tokens
    spread = ref_logits.max() - ref_logits.min()
    assert (logits - ref_logits).abs().max() <= (1e-5 if dtype == "float32" else 0.02) * spread
