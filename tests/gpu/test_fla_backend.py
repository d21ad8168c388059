"""fla-core's Gated DeltaNet kernels (engine/attention/linear_attention_fla.py) against the torch reference
backend on a CUDA device: a mixed batch of prefill chunks and decodes over state slots, then pure
decode steps, comparing outputs and the slots' states. Skipped without CUDA or fla-core.

First run on a GPU on 2026-11-26 (H100, fla-core 0.6.0, triton 3.6); docs/PERF.md has the results."""

from __future__ import annotations

import pytest
import torch

from engine.attention.linear_attention import TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.batch import build_forward_batch
from engine.weights.config.hybrid_config import HybridConfig
from scheduler.output import ScheduledRequest, SchedulerOutput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    pytest.importorskip("fla")
    from engine.attention.linear_attention_fla import FlaLinearAttentionBackend

CUDA = torch.device("cuda")
# float32 inputs: fla-core's chunk kernels multiply float32 through Triton's default dot precision,
# TF32 on Hopper (10-bit mantissa, ~5e-4 relative per product), so float32 agreement is TF32's, not
# float32's. The first GPU run measured up to 2.1e-4 absolute on O(1) outputs.
F32_TOL = dict(atol=1e-3, rtol=1e-3)
HYBRID = HybridConfig(
    layer_types=("linear_attention",),
    num_k_heads=2,
    num_v_heads=6,
    head_k_dim=64,
    head_v_dim=64,
    conv_kernel=4,
    partial_rotary_factor=0.25,
    has_vision=False,
)


def batch(requests: list[tuple[int, int, int]]) -> object:
    """(start position, new tokens, slot) per request; pages are irrelevant to DeltaNet."""
    scheduled = tuple(
        ScheduledRequest(f"r{i}", tuple(range(1, n + 1)), start, tuple(range(64)), True, state_slot=slot)
        for i, (start, n, slot) in enumerate(requests)
    )
    return build_forward_batch(SchedulerOutput(scheduled, ()), 16, CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_delta_rule_equals_the_torch_reference_over_slots(dtype: torch.dtype) -> None:
    ref_pool, fla_pool = StatePool(HYBRID, 8, CUDA), StatePool(HYBRID, 8, CUDA)
    ref, fla = TorchLinearAttentionBackend(ref_pool, CUDA), FlaLinearAttentionBackend(fla_pool, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    steps = [[(0, 100, 3), (0, 1, 5), (0, 37, 0)], [(100, 20, 3), (1, 1, 5), (37, 1, 0)], [(120, 1, 3), (2, 1, 5)]]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else F32_TOL
    for step in steps:
        b = batch(step)
        t = b.num_tokens
        q = torch.randn(t, 2, 64, device=CUDA, generator=g, dtype=dtype)
        k = torch.randn(t, 2, 64, device=CUDA, generator=g, dtype=dtype)
        v = torch.randn(t, 6, 64, device=CUDA, generator=g, dtype=dtype)
        decay = -torch.nn.functional.softplus(torch.randn(t, 6, device=CUDA, generator=g))
        beta = torch.rand(t, 6, device=CUDA, generator=g).to(dtype)
        ref.plan(b)
        fla.plan(b)
        torch.testing.assert_close(
            fla.delta_rule(0, q, k, v, decay, beta).float(), ref.delta_rule(0, q, k, v, decay, beta).float(), **tol
        )
        torch.testing.assert_close(fla_pool.recurrent, ref_pool.recurrent, **tol)


def test_fla_rounds_keep_the_states_the_torch_backend_keeps() -> None:
    """Hybrid prefix caching: states kept part way through a step (the fla call split into rounds)
    equal the torch backend's (computed inside its chunked form), and so do outputs and slots."""
    from engine.attention.checkpoint_pool import CheckpointPool
    from scheduler.output import CheckpointSave

    pools = [
        (StatePool(HYBRID, 8, CUDA), CheckpointPool(HYBRID, 4, (2, 16, 1, 64), 1, torch.float32, CUDA))
        for _ in range(2)
    ]
    ref = TorchLinearAttentionBackend(pools[0][0], CUDA, checkpoints=pools[0][1])
    fla = FlaLinearAttentionBackend(pools[1][0], CUDA, checkpoints=pools[1][1])
    saves = {0: (CheckpointSave(0, 64), CheckpointSave(1, 96)), 2: (CheckpointSave(2, 16),)}
    scheduled = tuple(
        ScheduledRequest(
            f"r{i}",
            tuple(range(1, n + 1)),
            start,
            tuple(range(64)),
            True,
            state_slot=slot,
            checkpoint_saves=saves.get(i, ()),
        )
        for i, (start, n, slot) in enumerate([(0, 100, 3), (0, 1, 5), (0, 37, 0)])
    )
    b = build_forward_batch(SchedulerOutput(scheduled, ()), 16, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    t = b.num_tokens
    q, k = (torch.randn(t, 2, 64, device=CUDA, generator=g) for _ in range(2))
    v = torch.randn(t, 6, 64, device=CUDA, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(t, 6, device=CUDA, generator=g))
    beta = torch.rand(t, 6, device=CUDA, generator=g)
    ref.plan(b)
    fla.plan(b)
    tol = F32_TOL
    torch.testing.assert_close(fla.delta_rule(0, q, k, v, decay, beta), ref.delta_rule(0, q, k, v, decay, beta), **tol)
    torch.testing.assert_close(pools[1][0].recurrent, pools[0][0].recurrent, **tol)
    torch.testing.assert_close(pools[1][1].recurrent[:, :3], pools[0][1].recurrent[:, :3], **tol)
