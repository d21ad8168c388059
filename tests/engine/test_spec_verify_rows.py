"""A speculative verify step on CPU runs its k + 1 rows through the int4 op together: each layer's
linears are called once with k + 1 rows (seen in torch.profiler's record of the op, the op itself
running), and greedy output is the same with and without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from engine.host.cpu_kernels import load_cpu_ops
from engine.models.decoder import DecoderLayer
from engine.weights import dtype_policy
from scheduler.request import SamplingParams
from tests.factories import make_checkpoint

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 1, 250] * 3


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("verifyrows"), "llama", tie=True, init_std=0.1)


def engine(path: Path, num_speculative_tokens: int = 0, **overrides: object) -> OfflineEngine:
    return OfflineEngine.from_config(
        EngineConfig(
            model=str(path),
            kv_cache_memory="4MiB",
            quantization="int4",
            speculative_method="ngram" if num_speculative_tokens else None,
            num_speculative_tokens=num_speculative_tokens,
            **overrides,  # type: ignore[arg-type]
        )
    )


@pytest.fixture
def dense_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int4 linears keep dense copies from AUTO_INT4_DENSE_FROM_ROWS rows, as `--quantization
    auto` gives the built-in model (an explicit int4 keeps none)."""
    from engine import model_runner

    monkeypatch.setattr(
        model_runner, "int8_dense_from_rows", lambda requested, scheme: dtype_policy.AUTO_INT4_DENSE_FROM_ROWS
    )


def int4_calls(prof: profile) -> list[list[int]]:
    """The input shapes [T, K] of every int4 op call torch.profiler recorded."""
    return [list(e.input_shapes[0]) for e in prof.events() if e.name == "fp4serve_cpu::int4_gemv"]


@pytest.mark.parametrize("k", [3, 4, 7])
def test_a_verify_step_calls_the_int4_op_once_per_linear_with_all_its_rows(checkpoint: Path, k: int) -> None:
    e = engine(checkpoint, k)
    layers = [m for m in e.core.runner.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(m.fused_weights is not None and m.fused_own_kernel for m in layers)
    # Drafts every step: the last token k times (a verify step costs the same whatever is accepted).
    e.core.scheduler.drafter = lambda request_id, tokens, n: [tokens[-1]] * n
    e.add_request(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    while not e.step():  # the prefill, to the first token
        pass
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        e.step()
    calls = int4_calls(prof)
    hidden = e.core.runner.model_config.hidden_size
    assert len(calls) == 4 * len(layers), calls  # qkv, o, gate_up, down: one call each per layer
    assert all(t == k + 1 for t, _ in calls), calls
    assert [c[1] for c in calls[:2]] == [hidden, hidden]


def test_auto_int4_keeps_verify_steps_of_up_to_8_rows_on_the_int4_op() -> None:
    """The dense copies (the checkpoint's bf16 weights, other numbers) serve only from 9 rows: a
    verify step of k + 1 <= 8 rows gets, row for row, the bits a one-row step gets."""
    assert dtype_policy.AUTO_INT4_DENSE_FROM_ROWS > 8


def test_verify_steps_past_the_dense_rows_stay_on_the_int4_op(checkpoint: Path, dense_copies: None) -> None:
    """A verify step of 9 rows (k = 8) would pass the row count where the dense copies take over;
    it stays on the int4 op (row for row the bits of a one-row step), while a plain batch of as
    many rows (three prefills) still takes the dense copies."""
    e = engine(checkpoint, 8, speculative_adaptive=False)
    layers = [m for m in e.core.runner.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(m.fused_below_rows == dtype_policy.AUTO_INT4_DENSE_FROM_ROWS for m in layers)
    e.core.scheduler.drafter = lambda request_id, tokens, n: [tokens[-1]] * n
    e.add_request(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    while not e.step():
        pass
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        e.step()
    calls = int4_calls(prof)
    assert len(calls) == 4 * len(layers) and all(t == 9 for t, _ in calls), calls

    plain = engine(checkpoint)
    for prompt in (PROMPT[:9], PROMPT[9:18], PROMPT[18:27]):
        plain.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        plain.step()  # 27 prompt rows: the dense copies
    assert int4_calls(prof) == []


@pytest.mark.parametrize("k", [4, 7, 8])
def test_greedy_output_is_the_same_with_and_without_speculation_on_int4(
    checkpoint: Path, k: int, dense_copies: None
) -> None:
    """Full verify steps of k + 1 rows, drafts partly right: the drafter proposes the plain run's next
    k tokens with the third one wrong, so each step accepts two drafts and rejects the rest. With
    the dense copies of `--quantization auto`: three requests' verify rows (15-27) are past their
    row count, the plain run's three decode rows are not."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:5], [9, 9, 9, 9, 9, 9]]
    plain = [r.token_ids[0] for r in engine(checkpoint).generate(prompts, params)]
    expected = [list(p) + out for p, out in zip(prompts, plain)]
    drafted: list[int] = []

    def drafter(request_id: str, tokens: list[int], n: int) -> list[int]:
        full = next(x for x in expected if x[: len(tokens)] == list(tokens))
        drafts = full[len(tokens) : len(tokens) + n]
        if len(drafts) > 2:
            drafts[2] = (drafts[2] + 1) % 100
        drafted.append(len(drafts))
        return drafts

    spec_engine = engine(checkpoint, k, speculative_adaptive=False)
    spec_engine.core.scheduler.drafter = drafter
    assert [r.token_ids[0] for r in spec_engine.generate(prompts, params)] == plain
    assert max(drafted) == k  # full verify steps ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 128), (6, 6, 40)], ids=["gqa3-d64", "gqa2-d128", "mha-d40"])
def test_verify_rows_attend_in_one_pass_with_the_bits_each_row_gets_alone(
    dtype: torch.dtype, heads: tuple[int, int, int]
) -> None:
    """The attention op takes a request's k + 1 rows in one pass over its keys (kernels/
    cpu_attention.cpp attend_rows); row j, which sees one key more than row j - 1, gets exactly what
    a one-row step at its position gets (its keys past its own count weigh 0)."""
    from kernels.cpu_attention import paged_attention, paged_attention_ref
    from tests.kernels.test_cpu_attention import make_batch

    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(head_dim)
    query_lens, seq_lens = [8, 5, 1], [70, 16, 33]
    batch = make_batch(query_lens, seq_lens, block_size=16, num_pages=16)
    cache = torch.randn(16, 2, 16, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=g).to(dtype)
    meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    together = paged_attention(q, cache, *meta, 0.125)
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(
        together.float(), paged_attention_ref(q, cache, *meta, 0.125).float(), rtol=tol, atol=tol
    )
    qo = batch.qo_indptr.tolist()
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        pages = batch.kv_indices[batch.kv_indptr[i] : batch.kv_indptr[i + 1]]
        for j in range(q_len):
            keys = seq_len - q_len + 1 + j  # what a one-row step at this position sees
            n = -(-keys // 16)
            alone = paged_attention(
                q[qo[i] + j : qo[i] + j + 1],
                cache,
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([0, n], dtype=torch.int32),
                pages[:n].contiguous(),
                torch.tensor([keys - (n - 1) * 16], dtype=torch.int32),
                0.125,
            )
            assert torch.equal(alone[0], together[qo[i] + j]), (i, j)
