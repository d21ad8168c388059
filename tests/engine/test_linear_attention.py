"""The linear-attention backend's per-step plan (decodes and padded prefill chunks, slots, fresh
slots zeroed) and its forward over a mixed batch against each sequence run alone."""

from __future__ import annotations

import torch

from engine.attention.linear_attention import LinearAttentionPlan, TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.batch import build_forward_batch
from engine.weights.config.hybrid_config import HybridConfig
from scheduler.output import ScheduledRequest, SchedulerOutput

CPU = torch.device("cpu")
HYBRID = HybridConfig(
    layer_types=("linear_attention", "full_attention"),
    num_k_heads=1,
    num_v_heads=2,
    head_k_dim=8,
    head_v_dim=4,
    conv_kernel=3,
    partial_rotary_factor=0.25,
    has_vision=False,
)


def batch(requests: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    """(start position, new tokens, slot) per request."""
    scheduled = tuple(
        ScheduledRequest(f"r{i}", tuple(range(1, n + 1)), start, tuple(range(8)), True, state_slot=slot)
        for i, (start, n, slot) in enumerate(requests)
    )
    return build_forward_batch(SchedulerOutput(scheduled, ()), 4, CPU)


def test_plan_groups_decodes_and_pads_prefill_chunks() -> None:
    b = batch([(0, 3, 2), (5, 1, 0), (4, 2, 1), (0, 1, 3)])
    assert b.state_slots == (2, 0, 1, 3)
    plan, fresh = LinearAttentionPlan.build(b, CPU, short_max=0)  # every multi-token row chunked
    assert fresh == [2, 3]  # the sequences starting at position 0
    assert plan.decode is not None and plan.prefill is not None
    assert plan.decode.flat_rows.tolist() == [3, 6] and plan.decode.slots.tolist() == [0, 3]
    assert plan.prefill.rows.tolist() == [[0, 1, 2], [4, 5, 5]]
    assert plan.prefill.mask.tolist() == [[True, True, True], [True, True, False]]
    assert plan.prefill.flat_rows.tolist() == [0, 1, 2, 4, 5] and plan.prefill.slots.tolist() == [2, 1]


def run(
    backend: TorchLinearAttentionBackend,
    requests: list[tuple[int, int, int]],
    x: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    backend.plan(batch(requests))
    mixed = backend.conv(0, x, weight)
    q, k, v = mixed.split([8, 8, 8], dim=-1)
    return backend.delta_rule(0, q.reshape(-1, 1, 8), k.reshape(-1, 1, 8), v.reshape(-1, 2, 4), g, beta)


def test_mixed_batch_equals_each_sequence_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 3, generator=gen)
    steps = [[(0, 5, 0), (0, 1, 1), (0, 9, 2)], [(5, 1, 0), (1, 3, 1), (9, 1, 2)]]
    inputs = []
    for step in steps:
        t = sum(n for _, n, _ in step)
        inputs.append(
            (torch.randn(t, 24, generator=gen), -torch.rand(t, 2, generator=gen), torch.rand(t, 2, generator=gen))
        )
    together = TorchLinearAttentionBackend(StatePool(HYBRID, 3, CPU), CPU)
    outs = [run(together, step, *inp[:1], weight, *inp[1:]) for step, inp in zip(steps, inputs)]
    for i in range(3):  # sequence i alone, in its own pool, through the same two steps
        alone = TorchLinearAttentionBackend(StatePool(HYBRID, 3, CPU), CPU)
        for step, inp, out in zip(steps, inputs, outs):
            start = sum(n for _, n, _ in step[:i])
            rows = slice(start, start + step[i][1])
            x, g, beta = (t[rows] for t in inp)
            torch.testing.assert_close(run(alone, [step[i]], x, weight, g, beta), out[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.pool.recurrent[:, i], together.pool.recurrent[:, i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.pool.conv[:, i], together.pool.conv[:, i])
