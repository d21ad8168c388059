"""CUDA graphs for hybrid (Gated DeltaNet) models and for verify steps (engine/cuda_graph.py,
engine/attention/linear_attention.py `plan_graph`), checked on CPU: capture is stood in for by a
capturer that re-runs the captured forward and holds it to a real graph's rules (no host sync, no
tensor at an address the capture did not see: tests/graph_fakes.py). The state-slot indices are
graph inputs refilled before each replay; padded rows touch only the scratch slot and page."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.gated_delta import sequential_gated_delta_rule
from engine.attention.hybrid_backend import HybridBackend
from engine.attention.linear_attention import TorchLinearAttentionBackend
from engine.attention.linear_attention_fla import FlaLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.cuda_graph import CudaGraphRunner, DecodeBuckets, graphs_disabled_reason, pad_decode_batch
from engine.weights.config.model_config import ModelConfig
from engine.weights.loader import load_model
from scheduler.output import ScheduledRequest, SchedulerOutput
from tests.factories import make_hybrid_checkpoint
from tests.graph_fakes import FakeCapturer, GraphableTorchBackend, StrictCapturer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BS = 4  # tokens per KV page
NUM_PAGES = SCRATCH_PAGE = 24  # the scheduler's pages 0..23, the scratch page one past them
NUM_SLOTS = 6  # the scheduler's state slots 0..5; the pool's scratch slot is 6
TABLES = {f"r{i}": [4 * i + j for j in range(4)] for i in range(5)}  # 16 tokens each
PROMPT = {"r0": 5, "r1": 9, "r2": 3, "r3": 7, "r4": 4}
SLOTS = {"r0": 3, "r1": 0, "r2": 5, "r3": 1, "r4": 4}  # not in request order: the slots are gathered
K = 3  # drafts per request in a verify step

Req = tuple[str, int, int, int]  # (request id, start position, new tokens, drafts among them)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelConfig]:
    path: Path = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid-graphs"))
    cfg = ModelConfig.from_checkpoint(path)
    return load_model(path, cfg, torch.float32, CPU, 64), cfg


def batch_of(*reqs: Req, slots: dict[str, int] = SLOTS) -> ForwardBatch:
    """Token ids follow the position (a draft's too), so repeated runs feed the same tokens."""
    return build_forward_batch(
        SchedulerOutput(
            tuple(
                ScheduledRequest(
                    rid,
                    tuple((7 * p + 3) % 500 for p in range(start, start + n)),
                    start,
                    tuple(TABLES[rid]),
                    True,
                    state_slot=slots[rid],
                    num_draft_tokens=drafts,
                )
                for rid, start, n, drafts in reqs
            ),
            (),
        ),
        BS,
        CPU,
    )


def caches_for(cfg: ModelConfig) -> list[torch.Tensor]:
    return [torch.zeros(NUM_PAGES + 1, 2, BS, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_kv_layers)]


def graph_runner(
    tiny: tuple[Any, ModelConfig], sizes: tuple[int, ...], verify_query_len: int | None = None
) -> tuple[CudaGraphRunner, StrictCapturer, StatePool]:
    model, cfg = tiny
    attention = GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    pool = StatePool(cfg.hybrid, NUM_SLOTS, CPU)
    backend = HybridBackend(attention, TorchLinearAttentionBackend(pool, CPU))
    capturer = StrictCapturer(exempt=attention.plan_storages)
    runner = CudaGraphRunner(
        model,
        caches_for(cfg),
        backend,
        DecodeBuckets(sizes),
        SCRATCH_PAGE,
        4,
        capturer,
        verify_query_len=verify_query_len,
    )
    return runner, capturer, pool


def eager_runner(
    tiny: tuple[Any, ModelConfig],
) -> tuple[Callable[[ForwardBatch], torch.Tensor], list[torch.Tensor], StatePool]:
    model, cfg = tiny
    caches, pool = caches_for(cfg), StatePool(cfg.hybrid, NUM_SLOTS, CPU)
    backend = HybridBackend(
        TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU),
        TorchLinearAttentionBackend(pool, CPU),
    )

    def forward(batch: ForwardBatch) -> torch.Tensor:
        backend.plan(batch)
        return model(batch.input_ids, batch.positions, caches, backend)

    return forward, caches, pool


def prefill(*names: str) -> ForwardBatch:
    return batch_of(*[(r, 0, PROMPT[r], 0) for r in names])


def assert_states_equal(got: StatePool, want: StatePool) -> None:
    torch.testing.assert_close(got.conv[:, :NUM_SLOTS], want.conv[:, :NUM_SLOTS], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.recurrent[:, :NUM_SLOTS], want.recurrent[:, :NUM_SLOTS], rtol=1e-5, atol=1e-5)


# ---- padding ------------------------------------------------------------------------------------
def test_padding_a_verify_step_gives_dummies_the_scratch_page_and_slot() -> None:
    batch = batch_of(("r0", 5, 1 + K, K), ("r1", 9, 1 + K, K))
    padded = pad_decode_batch(batch, 3, SCRATCH_PAGE, 1 + K, scratch_slot=NUM_SLOTS)
    assert padded.query_lens == [4, 4, 4] and padded.seq_lens == [9, 13, 4]
    assert padded.state_slots == (3, 0, NUM_SLOTS)
    assert padded.qo_indptr.tolist() == [0, 4, 8, 12]
    assert padded.kv_indptr.tolist() == [0, 3, 7, 8] and padded.kv_indices.tolist()[-1] == SCRATCH_PAGE
    assert padded.kv_last_page_len.tolist() == [1, 1, 4]
    assert padded.positions.tolist()[8:] == [0, 1, 2, 3]
    assert padded.slot_mapping.tolist()[8:] == [SCRATCH_PAGE * BS + j for j in range(4)]
    assert torch.equal(padded.logits_indices, batch.logits_indices)  # dummies are never sampled


# ---- capture ------------------------------------------------------------------------------------
@torch.inference_mode()
def test_capture_touches_only_the_scratch_slot_and_page(tiny: Any) -> None:
    runner, capturer, pool = graph_runner(tiny, (1, 2, 4), verify_query_len=1 + K)
    runner.capture()
    assert runner.captured_sizes == [1, 2, 4] and runner.captured_verify_sizes == [1, 2, 4]
    assert len(capturer.graphs) == 6
    assert pool.conv[:, :NUM_SLOTS].abs().sum() == 0 and pool.recurrent[:, :NUM_SLOTS].abs().sum() == 0
    assert pool.recurrent[:, NUM_SLOTS].abs().sum() > 0, "dummy rows ran on the scratch slot"
    for cache in runner.kv_caches:
        assert cache[:NUM_PAGES].abs().sum() == 0, "dummy rows wrote into a request's page"


def test_hybrid_graphs_need_an_attention_backend_that_captures(tiny: Any) -> None:
    _, cfg = tiny
    linear = TorchLinearAttentionBackend(StatePool(cfg.hybrid, NUM_SLOTS, CPU), CPU)
    eager = HybridBackend(TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU), linear)
    graphable = HybridBackend(GraphableTorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU), linear)
    assert "cannot be captured" in str(graphs_disabled_reason(False, CUDA, eager))
    assert graphs_disabled_reason(False, CUDA, graphable) is None


# ---- decode -------------------------------------------------------------------------------------
@torch.inference_mode()
def test_hybrid_graph_decode_equals_eager_at_several_batch_sizes(tiny: Any) -> None:
    runner, capturer, pool = graph_runner(tiny, (1, 2, 4, 8))
    runner.capture()
    eager, eager_caches, eager_pool = eager_runner(tiny)
    steps = [
        prefill(*PROMPT),  # eager in both
        batch_of(*[(r, n, 1, 0) for r, n in PROMPT.items()]),  # 5 decodes: bucket 8, 3 dummies
        batch_of(*[(r, PROMPT[r] + 1, 1, 0) for r in ("r0", "r2", "r4")]),  # bucket 4
        batch_of(*[(r, PROMPT[r] + 2, 1, 0) for r in ("r0", "r2")]),  # bucket 2, no padding
        batch_of(("r3", PROMPT["r3"] + 1, 1, 0)),  # bucket 1
    ]
    replayed = []
    for batch in steps:
        replayed.append(runner.graph_size_for(batch))
        got = runner.forward(batch)
        assert got.shape[0] == batch.num_tokens
        torch.testing.assert_close(got, eager(batch), rtol=1e-5, atol=1e-5)
    assert replayed == [None, 8, 4, 2, 1]
    assert [g.replays for g in capturer.graphs] == [1, 1, 1, 1]  # sizes 8, 4, 2, 1
    assert_states_equal(pool, eager_pool)
    for got, want in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(got[:NUM_PAGES], want[:NUM_PAGES], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_padded_rows_leave_every_other_slot_and_page_bit_identical(tiny: Any) -> None:
    runner, _, pool = graph_runner(tiny, (4,))
    runner.capture()
    g = torch.Generator().manual_seed(0)
    for t in (pool.conv, pool.recurrent, *runner.kv_caches):
        t.copy_(torch.randn(t.shape, generator=g))
    conv, recurrent = pool.conv.clone(), pool.recurrent.clone()
    caches = [c.clone() for c in runner.kv_caches]
    batch = batch_of(*[(r, PROMPT[r], 1, 0) for r in ("r0", "r2", "r4")])  # bucket 4: one dummy
    runner.forward(batch)
    real = [SLOTS[r] for r in ("r0", "r2", "r4")]
    for slot in range(NUM_SLOTS):
        same = torch.equal(pool.conv[:, slot], conv[:, slot]) and torch.equal(
            pool.recurrent[:, slot], recurrent[:, slot]
        )
        assert same == (slot not in real), f"slot {slot}"
    written = batch.slot_mapping.tolist()  # page * BS + offset of each real row's new K/V
    for got, before in zip(runner.kv_caches, caches):
        for page in range(NUM_PAGES):
            for offset in range(BS):
                same = torch.equal(got[page, :, offset], before[page, :, offset])
                assert same == (page * BS + offset not in written), f"page {page} offset {offset}"


@torch.inference_mode()
def test_slot_indices_are_refilled_between_replays_of_one_bucket(tiny: Any) -> None:
    runner, capturer, pool = graph_runner(tiny, (4,))
    runner.capture()
    eager, _, eager_pool = eager_runner(tiny)
    linear = runner.backend.linear  # type: ignore[attr-defined]
    address = linear._graph_slots.data_ptr()
    for batch in (
        prefill(*PROMPT),
        batch_of(*[(r, PROMPT[r], 1, 0) for r in ("r0", "r1", "r2")]),
        batch_of(*[(r, PROMPT[r], 1, 0) for r in ("r3", "r4")]),  # other requests, other slots
        batch_of(*[(r, PROMPT[r] + 1, 1, 0) for r in ("r4", "r0", "r3", "r1")]),
    ):
        torch.testing.assert_close(runner.forward(batch), eager(batch), rtol=1e-5, atol=1e-5)
    assert capturer.graphs[0].replays == 3
    assert linear._graph_slots.data_ptr() == address
    assert linear._graph_slots.tolist() == [SLOTS[r] for r in ("r4", "r0", "r3", "r1")]
    assert_states_equal(pool, eager_pool)


# ---- verify steps -------------------------------------------------------------------------------
@torch.inference_mode()
def test_verify_step_graphs_give_the_same_tokens_and_states_as_eager(tiny: Any) -> None:
    model, _ = tiny
    runner, capturer, pool = graph_runner(tiny, (1, 2, 4), verify_query_len=1 + K)
    runner.capture()
    eager, eager_caches, eager_pool = eager_runner(tiny)
    verify3 = batch_of(*[(r, PROMPT[r], 1 + K, K) for r in ("r0", "r1", "r2")])  # bucket 4, one dummy
    verify1 = batch_of(("r3", PROMPT["r3"], 1 + K, K))  # bucket 1
    ragged = batch_of(("r4", PROMPT["r4"], 1 + K, K), ("r1", PROMPT["r1"] + 1 + K, 2, 1))  # eager
    replayed = []
    for batch in (prefill(*PROMPT), verify3, verify1, ragged):
        replayed.append(runner.graph_size_for(batch))
        got = runner.forward(batch)
        want = eager(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got_tokens = model.compute_logits(got[batch.logits_indices]).argmax(dim=-1)
        assert torch.equal(got_tokens, model.compute_logits(want[batch.logits_indices]).argmax(dim=-1))
    assert replayed == [None, 4, 1, None]
    assert [g.replays for g in capturer.graphs] == [0, 0, 0, 1, 0, 1]  # decode 4, 2, 1; verify 4, 2, 1
    assert_states_equal(pool, eager_pool)
    for got, want in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(got[:NUM_PAGES], want[:NUM_PAGES], rtol=1e-5, atol=1e-5)


def test_verify_graphs_are_skipped_for_backends_without_them(tiny: Any) -> None:
    model, cfg = tiny
    attention = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, CPU)
    backend = HybridBackend(attention, TorchLinearAttentionBackend(StatePool(cfg.hybrid, NUM_SLOTS, CPU), CPU))
    runner = CudaGraphRunner(
        model, caches_for(cfg), backend, DecodeBuckets((1, 2)), SCRATCH_PAGE, 4, FakeCapturer(), verify_query_len=1 + K
    )
    assert runner.verify_query_len is None


# ---- the fla backend's graph path (its batch-layout kernel stood in for by the torch recurrence) ------------
def fla_batch_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's fused_recurrent_gated_delta_rule in its batch layout: [B, L, H, D], one sequence per row."""
    assert output_final_state and use_qk_l2norm_in_kernel and kwargs.get("cu_seqlens") is None
    return sequential_gated_delta_rule(q, k, v, g, beta, initial_state)


def unreachable(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError("a graph step ran the chunked kernel")


@pytest.mark.parametrize("rows", [1, 1 + K])
def test_fla_graph_step_equals_the_torch_backend_eagerly(tiny: Any, rows: int) -> None:
    _, cfg = tiny
    h = cfg.hybrid
    fla_pool, ref_pool = StatePool(h, NUM_SLOTS, CPU), StatePool(h, NUM_SLOTS, CPU)
    g = torch.Generator().manual_seed(rows)
    for pool in (fla_pool, ref_pool):
        pool.conv.copy_(torch.randn(pool.conv.shape, generator=torch.Generator().manual_seed(1)))
        pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=torch.Generator().manual_seed(2)))
    fla = FlaLinearAttentionBackend(fla_pool, CPU, kernels=(unreachable, fla_batch_stand_in))
    ref = TorchLinearAttentionBackend(ref_pool, CPU)
    fla.prepare_graphs([4])
    real = [(r, PROMPT[r], rows, rows - 1) for r in ("r0", "r2", "r4")]
    fla.plan_graph(pad_decode_batch(batch_of(*real), 4, SCRATCH_PAGE, rows, scratch_slot=NUM_SLOTS))
    ref.plan(batch_of(*real))
    t = 3 * rows
    x, weight = torch.randn(4 * rows, h.conv_dim, generator=g), torch.randn(h.conv_dim, h.conv_kernel, generator=g)
    q, k = (torch.randn(4 * rows, h.num_k_heads, h.head_k_dim, generator=g) for _ in range(2))
    v = torch.randn(4 * rows, h.num_v_heads, h.head_v_dim, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(4 * rows, h.num_v_heads, generator=g))
    beta = torch.rand(4 * rows, h.num_v_heads, generator=g)
    torch.testing.assert_close(fla.conv(0, x, weight)[:t], ref.conv(0, x[:t], weight))
    torch.testing.assert_close(
        fla.delta_rule(0, q, k, v, decay, beta)[:t],
        ref.delta_rule(0, q[:t], k[:t], v[:t], decay[:t], beta[:t]),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(fla_pool.conv[:, :NUM_SLOTS], ref_pool.conv[:, :NUM_SLOTS])
    torch.testing.assert_close(
        fla_pool.recurrent[:, :NUM_SLOTS], ref_pool.recurrent[:, :NUM_SLOTS], rtol=1e-5, atol=1e-5
    )
