"""The Gated DeltaNet torch kernels (engine/attention/gated_delta.py) against transformers' reference
functions, and the batching they rely on: padded segments leave states exact, a state carried
across calls equals one long call, the conv carries its last inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.attention.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule


def inputs(
    batch: int, length: int, hk: int, hv: int, dk: int = 8, dv: int = 4, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, hk, dk, generator=g)
    k = torch.randn(batch, length, hk, dk, generator=g)
    v = torch.randn(batch, length, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(batch, length, hv, generator=g))  # log decay <= 0
    beta = torch.rand(batch, length, hv, generator=g)
    state = torch.randn(batch, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length,chunk,hk,hv", [(21, 8, 2, 6), (64, 64, 2, 2), (5, 4, 1, 4), (70, 16, 3, 6)])
def test_chunked_form_matches_transformers(length: int, chunk: int, hk: int, hv: int) -> None:
    q, k, v, g, beta, state = inputs(2, length, hk, hv)
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hk,hv", [(2, 6), (4, 4)])
def test_recurrent_form_matches_transformers(hk: int, hv: int) -> None:
    q, k, v, g, beta, state = inputs(3, 1, hk, hv)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, final = recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    torch.testing.assert_close(out, ref_out[:, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(final, ref_state, atol=1e-6, rtol=1e-5)


def test_padded_segments_equal_each_sequence_alone() -> None:
    """Sequences of lengths 1, 5 and 13 in one padded [3, 13] call: pads carry g = beta = 0."""
    lengths = [1, 5, 13]
    q, k, v, g, beta, state = inputs(3, 13, 2, 4, seed=3)
    keep = (torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]).float()[..., None]
    out, final = chunk_gated_delta_rule(q, k, v, g * keep, beta * keep, state, chunk_size=4)
    for i, n in enumerate(lengths):
        alone_out, alone_state = chunk_gated_delta_rule(
            q[i : i + 1, :n],
            k[i : i + 1, :n],
            v[i : i + 1, :n],
            g[i : i + 1, :n],
            beta[i : i + 1, :n],
            state[i : i + 1],
            4,
        )
        torch.testing.assert_close(out[i, :n], alone_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], alone_state[0], atol=1e-5, rtol=1e-5)


def test_state_carried_through_chunks_and_decode_steps_equals_one_call() -> None:
    q, k, v, g, beta, state = inputs(1, 30, 2, 4, seed=5)
    full_out, full_state = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8)
    s = state
    pieces = []
    for a, b in ((0, 11), (11, 27)):  # two prefill chunks, then three decode steps
        o, s = chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s, chunk_size=8)
        pieces.append(o)
    for t in range(27, 30):
        o, s = recurrent_gated_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        pieces.append(o[:, None])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, full_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [2, 4, 5])
def test_conv_carries_its_last_inputs_across_calls(kernel: int) -> None:
    g = torch.Generator().manual_seed(kernel)
    channels, length = 6, 11
    x = torch.randn(1, channels, length, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    ref = hf.causal_conv1d_fn(x, weight, None, activation="silu")  # zero history, whole sequence
    state = torch.zeros(1, channels, kernel - 1)
    outs = []
    for a, b in ((0, 1), (1, 3), (3, 4), (4, 11)):  # pieces shorter and longer than the kernel
        o, state = causal_conv1d(x[:, :, a:b], state, weight, torch.tensor([b - a]))
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, x[:, :, length - (kernel - 1) :])


def test_conv_over_padded_rows_keeps_each_rows_state() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g)  # row 0 has 2 real columns, row 1 has 5
    state = torch.randn(2, 3, 3, generator=g)
    weight = torch.randn(3, 4, generator=g)
    out, new_state = causal_conv1d(x, state, weight, torch.tensor([2, 5]))
    torch.testing.assert_close(new_state[0], torch.cat([state[0, :, 2:], x[0, :, :2]], dim=-1))
    torch.testing.assert_close(new_state[1], x[1, :, 2:])
    alone, _ = causal_conv1d(x[:1, :, :2], state[:1], weight, torch.tensor([2]))
    torch.testing.assert_close(out[:1, :, :2], alone)
