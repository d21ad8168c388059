"""MTP speculative decoding (engine/spec_decode/mtp.py) on tiny random Qwen3.5 checkpoints with
random `mtp.*` tensors: every draft equals a dense reference of the MTP maths (transformers' own
decoder layer over the whole sequence, causal mask, no paging), greedy output equals the output
without speculation and transformers' under concurrency and preemption, seeded sampling keeps its
tokens, and checkpoints that cannot do MTP fail start-up with one clear line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.spec_decode import record_steps
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams
from tests.engine.test_spec_decode import make_engine, num_accepted
from tests.factories import make_hybrid_checkpoint, make_hybrid_moe_checkpoint
from tests.mtp_factory import DenseMtpReference, add_mtp_tensors, make_predictable

K = 3


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_tensors(make_hybrid_checkpoint(tmp_path_factory.mktemp("mtp")))


@pytest.fixture(scope="module")
def predictable_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_predictable(add_mtp_tensors(make_hybrid_checkpoint(tmp_path_factory.mktemp("mtp_pred"), seed=4)))


def mtp_engine(path: Path, **overrides: Any) -> OfflineEngine:
    overrides = {"speculative_max_batch": 8, "enable_prefix_caching": False, **overrides}
    return make_engine(path, speculative_method="mtp", num_speculative_tokens=K, **overrides)


def record_drafts(engine: OfflineEngine) -> list[tuple[list[int], int, list[int]]]:
    """Every (context, k, drafts) the scheduler gets from the MTP drafter from now on."""
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = engine.core.scheduler.drafter
    assert propose is not None

    def recording(request_id: str, context: list[int], k: int) -> list[int]:
        drafts = propose(request_id, context, k)
        calls.append((list(context), k, drafts))
        return drafts

    engine.core.scheduler.drafter = recording
    return calls


def random_prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def test_drafts_equal_a_dense_reference_of_the_mtp_maths(mtp_ckpt: Path) -> None:
    """Every draft the engine hands the scheduler (chunked prefills across pages, 3 requests in
    one batch, K chained steps) is the dense reference's greedy chain for that context: a wrong
    layout, shift by one, position, norm or KV fill changes them. Greedy output is unchanged."""
    ps = random_prompts(5, 20, 37)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = mtp_engine(mtp_ckpt, max_num_batched_tokens=24)
    calls = record_drafts(engine)
    got = engine.generate(ps, params)
    ref = make_engine(mtp_ckpt, enable_prefix_caching=False).generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.token_ids[0] for r in got[:2]] == transformers_greedy(mtp_ckpt, ps[:2], 12)
    reference = DenseMtpReference(mtp_ckpt)
    # A request whose last prompt token runs alone has sampled nothing yet: no drafts for it.
    assert len(calls) > 10 and all(drafts or context in ps for context, _, drafts in calls)
    for context, k, drafts in (c for c in calls if c[2]):
        assert drafts == reference.drafts(context, K)[:k], f"context of {len(context)} tokens"


def test_requests_of_one_length_and_tail_get_their_own_drafts(mtp_ckpt: Path) -> None:
    """Drafts are keyed by request id: two prompts of the same length sharing their last 24 tokens
    (but not their first ones) each get the drafts of their own context."""
    head_a, head_b, tail = random_prompts(6, 6, 24, seed=13)
    ps = [head_a + tail, head_b + tail]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = mtp_engine(mtp_ckpt)
    calls = record_drafts(engine)
    engine.generate(ps, params)
    reference = DenseMtpReference(mtp_ckpt)
    checked = [(context, k, drafts) for context, k, drafts in calls if drafts]
    assert {tuple(context[:6]) for context, _, _ in checked} == {tuple(head_a), tuple(head_b)}
    assert any(
        reference.drafts(a, K) != reference.drafts(b, K)
        for (a, _, _), (b, _, _) in zip(checked, checked[1:])
        if len(a) == len(b) and a[:6] != b[:6]
    ), "the two contexts must draft differently for this to test"
    for context, k, drafts in checked:
        assert drafts == reference.drafts(context, K)[:k], f"context of {len(context)} tokens"


def test_greedy_output_exact_with_acceptances_rollbacks_and_preemption(predictable_ckpt: Path) -> None:
    """A target that often emits what the MTP drafts (tests/mtp_factory.py make_predictable):
    full acceptances (drafts into scratch pages past the request's own), partial ones (hybrid
    rollback), six requests of different lengths, and a KV pool small enough to preempt."""
    ps = random_prompts(3, 9, 14, 22, 30, 41, seed=5)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 24, 7, 24, 24, 24)]
    small = dict(kv_cache_memory="72KiB", max_num_seqs=6)
    ref = make_engine(predictable_ckpt, enable_prefix_caching=False, **small).generate(ps, params)
    engine = mtp_engine(predictable_ckpt, **small)
    steps = record_steps(engine)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.token_ids[0] for r in got[:3]] == transformers_greedy(predictable_ckpt, ps[:3], 24)[:2] + [
        transformers_greedy(predictable_ckpt, ps[2:3], 7)[0]
    ]
    drafted = sum(sum(s.num_drafts_by_position) for s in steps)
    accepted_last = sum(s.num_accepted_by_position[-1] for s in steps if len(s.num_accepted_by_position) == K)
    assert 0 < accepted_last and num_accepted(steps) < drafted, "full acceptances and rejections both happen"
    assert engine.core.scheduler.num_preemptions > 0
    assert len(steps) < sum(p.max_tokens or 0 for p in params), "steps emitted several tokens"


def test_seeded_sampling_keeps_its_tokens(mtp_ckpt: Path) -> None:
    ps = random_prompts(6, 18, 29, seed=9)
    params = [SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    ref = make_engine(mtp_ckpt, enable_prefix_caching=False).generate(ps, params)
    engine = mtp_engine(mtp_ckpt)
    steps = record_steps(engine)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert sum(sum(s.num_drafts_by_position) for s in steps) > 0


def test_start_up_refuses_what_cannot_do_mtp(tmp_path: Path, qwen3_ckpt: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs a dense Qwen3.5/3.6 checkpoint with mtp\.\* weights, not Qwen3"):
        mtp_engine(qwen3_ckpt)
    plain = make_hybrid_checkpoint(tmp_path / "no_mtp")
    with pytest.raises(ConfigError, match=r"has no mtp\.\* tensors .*use --speculative-method ngram") as e:
        mtp_engine(plain)
    assert "\n" not in str(e.value)
    moe = make_hybrid_moe_checkpoint(tmp_path / "moe")
    with pytest.raises(ConfigError, match="Qwen3.5-MoE"):
        mtp_engine(moe)


def test_conditional_generation_layout_with_tied_embeddings(tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration keeps the text model under model.language_model.* and the
    MTP head at top-level mtp.*; with tied embeddings lm_head is embed_tokens for MTP too."""
    path = add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "vl", layout="vl", tie=True))
    ps = random_prompts(7, 19, seed=21)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = mtp_engine(path)
    calls = record_drafts(engine)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in make_engine(path).generate(ps, params)]
    reference = DenseMtpReference(path)
    checked = [c for c in calls if c[2]]
    assert checked
    for context, k, drafts in checked[::3]:
        assert drafts == reference.drafts(context, K)[:k]
