"""The short-row path of the Gated DeltaNet (engine/attention/gated_delta.py sequential_gated_delta_rule,
routed by engine/attention/linear_attention.py for rows of 2..SHORT_ROW_MAX tokens): the token-by-token
recurrence equals the chunked form and transformers' recurrent reference, with initial states,
padded rows and lengths around the threshold, and the backend gives the same outputs and states
whichever group a row lands in."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.attention.gated_delta import chunk_gated_delta_rule, sequential_gated_delta_rule
from engine.attention.linear_attention import SHORT_ROW_MAX, LinearAttentionPlan, TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from tests.engine.test_gated_delta import inputs
from tests.engine.test_linear_attention import CPU, HYBRID, batch, run

LENGTHS = [1, 2, SHORT_ROW_MAX - 1, SHORT_ROW_MAX, SHORT_ROW_MAX + 1, 40]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("hk,hv", [(1, 2), (2, 6)])
def test_recurrence_equals_chunked_form_and_transformers(length: int, hk: int, hv: int) -> None:
    q, k, v, g, beta, state = inputs(3, length, hk, hv, seed=length)
    out, final = sequential_gated_delta_rule(q, k, v, g, beta, state)
    chunk_out, chunk_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, chunk_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, chunk_final, atol=2e-5, rtol=1e-5)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state, atol=2e-5, rtol=1e-5)
    assert not torch.equal(final, state)  # the rows moved the state


def test_recurrence_leaves_its_inputs_and_keeps_dtype() -> None:
    q, k, v, g, beta, state = inputs(2, 5, 1, 2, seed=7)
    before = state.clone()
    out, _ = sequential_gated_delta_rule(q, k, v.to(torch.bfloat16), g, beta, state)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 2, 4)
    assert torch.equal(state, before)  # the in-place updates run on a copy


def test_padded_short_rows_keep_each_rows_state() -> None:
    """Rows of 3 and 7 tokens padded to 7 (g = 0, beta = 0 on pads) equal each row run alone."""
    q, k, v, g, beta, state = inputs(2, 7, 1, 2, seed=3)
    keep = torch.tensor([[1.0] * 3 + [0.0] * 4, [1.0] * 7])[..., None]
    out, final = sequential_gated_delta_rule(q, k, v, g * keep, beta * keep, state)
    for row, n in enumerate((3, 7)):
        alone, alone_final = sequential_gated_delta_rule(
            q[row : row + 1, :n],
            k[row : row + 1, :n],
            v[row : row + 1, :n],
            g[row : row + 1, :n],
            beta[row : row + 1, :n],
            state[row : row + 1],
        )
        torch.testing.assert_close(out[row : row + 1, :n], alone, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(final[row : row + 1], alone_final, atol=1e-6, rtol=1e-5)


def test_plan_routes_rows_by_length() -> None:
    b = batch([(0, 1, 0), (4, 3, 1), (0, SHORT_ROW_MAX + 1, 2), (9, SHORT_ROW_MAX, 3)])
    plan, _ = LinearAttentionPlan.build(b, CPU)
    assert plan.decode is not None and plan.decode.slots.tolist() == [0]
    assert plan.short is not None and plan.short.slots.tolist() == [1, 3]
    assert plan.short.lengths.tolist() == [3, SHORT_ROW_MAX]
    assert plan.prefill is not None and plan.prefill.slots.tolist() == [2]
    chunked_only, _ = LinearAttentionPlan.build(b, CPU, short_max=0)
    assert chunked_only.short is None and chunked_only.prefill is not None
    assert chunked_only.prefill.slots.tolist() == [1, 2, 3]


def test_backend_outputs_and_states_do_not_depend_on_the_route() -> None:
    """Three steps of a mixed batch (a long prefill, verify-sized rows, decodes) through backends
    that chunk every row (short_max 0), route rows <= 4 or <= 16 to the recurrence."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 3, generator=gen)
    steps = [
        [(0, 20, 0), (0, 3, 1), (0, 1, 2)],
        [(20, 5, 0), (3, 4, 1), (1, 17, 2)],
        [(25, 1, 0), (7, 2, 1), (18, 3, 2)],
    ]
    inputs_ = []
    for step in steps:
        t = sum(n for _, n, _ in step)
        inputs_.append(
            (torch.randn(t, 24, generator=gen), -torch.rand(t, 2, generator=gen), torch.rand(t, 2, generator=gen))
        )
    results = []
    for short_max in (0, 4, SHORT_ROW_MAX):
        backend = TorchLinearAttentionBackend(StatePool(HYBRID, 3, CPU), CPU, short_max=short_max)
        outs = [run(backend, step, x, weight, g, beta) for step, (x, g, beta) in zip(steps, inputs_)]
        results.append((outs, backend.pool.recurrent.clone(), backend.pool.conv.clone()))
    for outs, recurrent, conv in results[1:]:
        for out, ref in zip(outs, results[0][0]):
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(recurrent, results[0][1], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(conv, results[0][2])
