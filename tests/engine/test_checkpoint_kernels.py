"""States kept part way through a step (hybrid prefix caching): the chunked and recurrent forms of
the gated delta rule and the conv give the state after any number of a row's tokens; both DeltaNet
backends write them into the checkpoint pool, the torch one from inside its kernels, the fla one
by splitting its varlen call into rounds (checked here through a torch stand-in with fla-core's
signature); the pool's copies move states and KV pages both ways."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    conv_states_at,
    sequential_gated_delta_rule,
)
from engine.attention.linear_attention import TorchLinearAttentionBackend
from engine.attention.linear_attention_fla import FlaLinearAttentionBackend, Round
from engine.attention.state_pool import StatePool
from engine.batch import ForwardBatch, build_forward_batch
from engine.weights.config.hybrid_config import HybridConfig
from scheduler.output import CheckpointSave, ScheduledRequest, SchedulerOutput

CPU = torch.device("cpu")
HYBRID = HybridConfig(
    layer_types=("linear_attention", "full_attention"),
    num_k_heads=2,
    num_v_heads=4,
    head_k_dim=8,
    head_v_dim=8,
    conv_kernel=4,
    partial_rotary_factor=0.25,
    has_vision=False,
)


def rule_inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(batch, length, 4, 8, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(batch, length, 4, generator=g))
    beta = torch.rand(batch, length, 4, generator=g)
    return q, k, v, decay, beta, torch.randn(batch, 4, 8, 8, generator=g)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_states_inside_a_row_equal_the_recurrence_over_its_prefix(chunk_size: int) -> None:
    q, k, v, g, beta, state = rule_inputs(3, 37)
    wanted = [(0, 1), (1, 4), (2, 5), (0, 16), (1, 17), (2, 36), (0, 37), (1, 33)]
    chunked, stepped = torch.empty(len(wanted), 4, 8, 8), torch.empty(len(wanted), 4, 8, 8)
    out, final = chunk_gated_delta_rule(
        q, k, v, g, beta, state, chunk_size=chunk_size, snapshots=wanted, snapshot_states=chunked
    )
    out2, final2 = sequential_gated_delta_rule(q, k, v, g, beta, state, snapshots=wanted, snapshot_states=stepped)
    torch.testing.assert_close(out, out2, atol=2e-5, rtol=2e-5)  # the snapshots change nothing else
    torch.testing.assert_close(final, final2, atol=2e-5, rtol=2e-5)
    for i, (row, t) in enumerate(wanted):
        _, ref = sequential_gated_delta_rule(*(x[row : row + 1, :t] for x in (q, k, v, g, beta)), state[row : row + 1])
        torch.testing.assert_close(chunked[i], ref[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(stepped[i], ref[0], atol=1e-6, rtol=1e-6)


def test_conv_states_part_way_equal_the_end_state_of_a_shorter_row() -> None:
    g = torch.Generator().manual_seed(1)
    x, state, weight = (
        torch.randn(2, 6, 9, generator=g),
        torch.randn(2, 6, 3, generator=g),
        torch.randn(6, 4, generator=g),
    )
    rows, done = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1, 2, 3, 5, 9])  # 1 and 2 reach into the old state
    got = conv_states_at(x, state, weight, rows, done)
    for i, (row, n) in enumerate(zip(rows.tolist(), done.tolist())):
        _, ref = causal_conv1d(x[row : row + 1, :, :n], state[row : row + 1], weight, torch.tensor([n]))
        torch.testing.assert_close(got[i], ref[0])


def batch_of(
    requests: list[tuple[int, int, int, tuple[int, ...]]], saves: dict[int, list[tuple[int, int]]]
) -> ForwardBatch:
    """(start, new tokens, slot, block table) per request; saves: request -> (tokens done, checkpoint)."""
    return build_forward_batch(
        SchedulerOutput(
            tuple(
                ScheduledRequest(
                    f"r{i}",
                    tuple(range(1, n + 1)),
                    start,
                    table,
                    True,
                    state_slot=slot,
                    checkpoint_saves=tuple(CheckpointSave(c, start + d) for d, c in saves.get(i, ())),
                )
                for i, (start, n, slot, table) in enumerate(requests)
            ),
            (),
        ),
        4,
        CPU,
    )


def layer_inputs(t: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """(conv input, conv weight), (q, k, v, g, beta) of one DeltaNet layer for t tokens."""
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(t, HYBRID.conv_dim, generator=g), torch.randn(HYBRID.conv_dim, 4, generator=g)
    q, k = (torch.randn(t, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(t, 4, 8, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(t, 4, generator=g))
    return (x, weight), (q, k, v, decay, torch.rand(t, 4, generator=g))


def run_layer(
    backend: TorchLinearAttentionBackend, batch: ForwardBatch, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    (x, weight), rule = layer_inputs(batch.num_tokens, seed)
    backend.plan(batch)
    return backend.conv(0, x, weight), backend.delta_rule(0, *rule)


def fla_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's varlen chunk_gated_delta_rule signature over the torch recurrence."""
    assert output_final_state and use_qk_l2norm_in_kernel and q.shape[0] == 1
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        o, f = sequential_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state[i : i + 1]
        )
        outs.append(o)
        finals.append(f)
    return torch.cat(outs, dim=1), torch.cat(finals)


def pools() -> tuple[StatePool, CheckpointPool]:
    return StatePool(HYBRID, 4, CPU), CheckpointPool(HYBRID, 6, (2, 4, 2, 8), 1, torch.float32, CPU)


STEP = [(0, 40, 2, tuple(range(10))), (3, 1, 0, (0,)), (8, 9, 1, (0, 1, 2, 3, 4))]
SAVES = {0: [(5, 3), (16, 0), (33, 4)], 2: [(4, 1)]}  # request 0 keeps 3 states, request 2 one


@pytest.mark.parametrize("backend_kind", ["torch", "fla-rounds"])
def test_backends_keep_the_states_a_split_step_would_end_with(backend_kind: str) -> None:
    """One step keeping states part way equals the same tokens run as several steps, cut there."""
    slots, checkpoints = pools()
    slots.recurrent.normal_(generator=torch.Generator().manual_seed(9))
    slots.conv.normal_(generator=torch.Generator().manual_seed(10))
    start_conv, start_rec = slots.conv.clone(), slots.recurrent.clone()
    backend: TorchLinearAttentionBackend
    if backend_kind == "torch":
        backend = TorchLinearAttentionBackend(slots, CPU, checkpoints=checkpoints)
    else:
        backend = FlaLinearAttentionBackend(slots, CPU, checkpoints=checkpoints, kernels=(fla_stand_in, fla_stand_in))
    conv_out, rule_out = run_layer(backend, batch_of(STEP, SAVES), seed=5)
    reference, _ = pools()
    reference.conv.copy_(start_conv)
    reference.recurrent.copy_(start_rec)
    plain = TorchLinearAttentionBackend(reference, CPU)
    ref_conv, ref_rule = run_layer(plain, batch_of(STEP, {}), seed=5)
    torch.testing.assert_close(conv_out, ref_conv)
    torch.testing.assert_close(rule_out, ref_rule, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(slots.recurrent, reference.recurrent, atol=2e-5, rtol=2e-5)
    for index, kept in SAVES.items():  # each kept state: that request alone, its first d tokens
        start, _, slot, table = STEP[index]
        for done, checkpoint_id in kept:
            alone, _ = pools()
            alone.conv.copy_(start_conv)
            alone.recurrent.copy_(start_rec)
            cut = TorchLinearAttentionBackend(alone, CPU)
            full = batch_of(STEP, {})
            offset = full.qo_indptr[index].item()
            conv_in, rule_in = layer_inputs(full.num_tokens, seed=5)
            cut.plan(batch_of([(start, done, slot, table)], {}))
            rows = slice(offset, offset + done)
            cut.conv(0, conv_in[0][rows], conv_in[1])
            cut.delta_rule(0, *(x[rows] for x in rule_in))
            torch.testing.assert_close(checkpoints.conv[0, checkpoint_id], alone.conv[0, slot])
            torch.testing.assert_close(
                checkpoints.recurrent[0, checkpoint_id], alone.recurrent[0, slot], atol=2e-5, rtol=2e-5
            )


def test_fla_rounds_cut_each_request_at_its_kept_states() -> None:
    rounds = Round.split(batch_of(STEP, SAVES), CPU)
    # Round 0: every request's first piece (request 0 up to 5 tokens, 1 whole, 2 up to 4); round 1:
    # request 0's tokens 5..15 and request 2's rest; rounds 2 and 3: request 0's 16..32 and 33..39.
    assert [r.requests.tolist() for r in rounds] == [[0, 1, 2], [0, 2], [0], [0]]
    assert [r.cu_seqlens.tolist() for r in rounds] == [[0, 5, 6, 10], [0, 11, 16], [0, 17], [0, 7]]
    assert rounds[0].tokens.tolist() == [0, 1, 2, 3, 4, 40, 41, 42, 43, 44]
    assert [(r.save_ids.tolist() if r.save_ids is not None else None) for r in rounds] == [[3, 1], [0], [4], None]


def test_the_pool_copies_states_and_pages_both_ways() -> None:
    slots, checkpoints = pools()
    slots.conv.normal_()
    slots.recurrent.normal_()
    kv = [torch.randn(8, 2, 4, 2, 8)]
    checkpoints.save(slots, [4, 1], [2, 0])
    checkpoints.save_pages(kv, [4], [6])
    assert torch.equal(checkpoints.recurrent[:, 4], slots.recurrent[:, 2]) and torch.equal(
        checkpoints.conv[:, 1], slots.conv[:, 0]
    )
    other = StatePool(HYBRID, 4, CPU)
    checkpoints.restore(other, [4], [3])
    checkpoints.restore_pages(kv, [4], [1])
    assert torch.equal(other.recurrent[:, 3], slots.recurrent[:, 2]) and torch.equal(other.conv[:, 3], slots.conv[:, 2])
    assert torch.equal(kv[0][1], kv[0][6])
    assert checkpoints.bytes_per_checkpoint == HYBRID.state_bytes_per_slot() + 2 * 4 * 2 * 8 * 4
