"""Hybrid prefix caching end to end (engine, float32, a tiny hybrid in Qwen3.6-27B's layout: three
Gated DeltaNet layers then one gated-attention layer, twice): greedy output with caching on equals
caching off and transformers, token for token, for hits at the end of a previous answer (inside a
page), at page boundaries (the snapshot grid and a shared prefix's junction), at chunk boundaries,
under concurrency with small forced chunks, under preemption, with n-gram and MTP speculation, and
when a template rewrites the history (a partial hit, never a wrong one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import hf_greedy, make_engine
from tests.factories import make_hybrid_checkpoint
from tests.mtp_factory import DenseMtpReference, add_mtp_tensors

LIN, FULL = "linear_attention", "full_attention"
LAYOUT_27B = dict(num_hidden_layers=8, layer_types=[LIN, LIN, LIN, FULL] * 2, max_position_embeddings=1024)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def words(n: int, seed: int) -> list[int]:
    return torch.randint(0, 510, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid27b_layout"), **LAYOUT_27B)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_tensors(make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_mtp"), **LAYOUT_27B))


def one(engine: OfflineEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens served from the cache."""
    [r] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))
    return r.token_ids[0], r.outputs[0][-1].num_cached_tokens


def agent_turns(engine: OfflineEngine, num_turns: int, max_tokens: int = 6) -> list[tuple[list[int], list[int], int]]:
    """Each turn: the previous prompt + its answer + a new message. (prompt, output, cached)."""
    prompt = words(149, 0)
    turns = []
    for turn in range(num_turns):
        out, cached = one(engine, prompt, max_tokens)
        turns.append((prompt, out, cached))
        prompt = prompt + out + words(27 + turn, turn + 1)
    return turns


def test_agent_turns_restore_the_previous_answer_and_equal_caching_off_and_transformers(ckpt: Path) -> None:
    on = agent_turns(make_engine(ckpt), 4)
    off = agent_turns(make_engine(ckpt, enable_prefix_caching=False), 4)
    assert [t[1] for t in on] == [t[1] for t in off]
    for prompt, out, _ in on[::3]:
        assert out == hf_greedy(ckpt, prompt, len(out))[0]
    # Each later turn restores the previous sequence's state after its last computed token (the
    # last sampled token never ran): positions 154, 187, 221 are all inside a 16-token page.
    expected = [0] + [len(p) + len(o) - 1 for p, o, _ in on[:-1]]
    assert [t[2] for t in on] == expected and all(c % 16 for c in expected[1:])
    assert all(t[2] == 0 for t in off)


def test_a_shared_prefix_restores_on_the_grid_then_at_its_junction(ckpt: Path) -> None:
    system = words(301, 7)  # an odd length: 18 full pages and 13 tokens
    engine = make_engine(ckpt, state_checkpoint_spacing=1.0)  # grid at 1, 2, 4, 8, 16 pages
    off = make_engine(ckpt, enable_prefix_caching=False)
    users = [system + words(20, 100 + u) for u in range(3)]
    got = [one(engine, u, 5) for u in users]
    assert [c for _, c in got] == [0, 256, 288]  # grid (16 pages), then the junction user 2 left (18)
    assert [o for o, _ in got] == [one(off, u, 5)[0] for u in users]
    assert got[2][0] == hf_greedy(ckpt, users[2], 5)[0]


def test_a_chunk_boundary_snapshot_restores_exactly(ckpt: Path) -> None:
    # 32-token steps: the first prompt's chunks end at 32, 64, 96 (all on the 1-bit grid: 2, 4 pages).
    engine = make_engine(ckpt, max_num_batched_tokens=32, long_prefill_token_threshold=32, state_checkpoint_spacing=1.0)
    off = make_engine(ckpt, enable_prefix_caching=False)
    first, second = words(100, 3), words(70, 3) + words(30, 4)
    assert one(engine, first, 4)[1] == 0
    out, cached = one(engine, second, 6)
    assert cached == 64 and out == one(off, second, 6)[0] == hf_greedy(ckpt, second, 6)[0]


def test_a_rewritten_history_only_misses(ckpt: Path) -> None:
    """A template that drops the previous answer's reasoning: the new prompt shares the old one up
    to where the assistant turn starts, then differs. The hit stops there."""
    engine = make_engine(ckpt)
    prompt = words(120, 11)
    answer, _ = one(engine, prompt, 8)
    rewritten = prompt[:-5] + [7, 7] + answer[3:] + words(20, 12)  # the last 5 prompt tokens and 3 answer tokens differ
    out, cached = one(engine, rewritten, 6)
    assert 0 < cached <= len(prompt) - 5
    assert out == hf_greedy(ckpt, rewritten, 6)[0]


def test_concurrent_small_chunks_and_preemption_equal_caching_off(ckpt: Path) -> None:
    """Two rounds of six requests at once sharing two heads and continuing earlier sequences, in
    4-token pages and 16-token steps, in a KV pool small enough to preempt."""
    small: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory="40KiB", max_num_seqs=4)
    heads = [words(37, 20), words(45, 21)]
    first = [heads[i % 2] + words(3 + i, 30 + i) for i in range(6)]
    params = SamplingParams(max_tokens=8, **GREEDY)

    def rounds(engine: OfflineEngine) -> tuple[list[list[int]], list[int]]:
        results = engine.generate(first, params)
        done = [p + r.token_ids[0] for p, r in zip(first, results)]
        second = [done[i] + words(5, 40 + i) if i % 2 else heads[i % 2] + words(9, 50 + i) for i in range(6)]
        results += engine.generate(second, params)
        return [r.token_ids[0] for r in results], [r.outputs[0][-1].num_cached_tokens for r in results]

    engine = make_engine(ckpt, **small)
    got, cached = rounds(engine)
    want, _ = rounds(make_engine(ckpt, enable_prefix_caching=False, **small))
    assert got == want
    assert engine.core.scheduler.num_preemptions > 0 and sum(c > 0 for c in cached[6:]) >= 4
    ck = engine.core.scheduler.checkpoints
    assert ck is not None
    ck.check_invariants()


def test_ngram_speculation_with_cached_turns(ckpt: Path) -> None:
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    on = agent_turns(make_engine(ckpt, **spec), 3, max_tokens=10)
    off = agent_turns(make_engine(ckpt, enable_prefix_caching=False), 3, max_tokens=10)
    assert [t[1] for t in on] == [t[1] for t in off]
    assert all(t[2] > 0 for t in on[1:])


def test_mtp_speculation_with_cached_turns_drafts_from_an_exact_context(mtp_ckpt: Path) -> None:
    """Output is exact whatever the drafts; and a turn that restores the previous sequence drafts
    what the dense MTP reference drafts over the whole context (the MTP head's KV of the restored
    prefix, its partial page included, is the one the earlier turn wrote)."""
    engine = make_engine(mtp_ckpt, speculative_method="mtp", num_speculative_tokens=3, speculative_max_batch=8)
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = engine.core.scheduler.drafter
    assert propose is not None

    def recording(request_id: str, context: list[int], k: int) -> list[int]:
        drafts = propose(request_id, context, k)
        calls.append((list(context), k, drafts))
        return drafts

    engine.core.scheduler.drafter = recording
    on = agent_turns(engine, 3, max_tokens=8)
    off = agent_turns(make_engine(mtp_ckpt, enable_prefix_caching=False), 3, max_tokens=8)
    assert [t[1] for t in on] == [t[1] for t in off] and all(t[2] > 0 for t in on[1:])
    reference = DenseMtpReference(mtp_ckpt)
    later = [c for c in calls if c[2] and len(c[0]) > len(on[1][0])]
    assert later
    for context, k, drafts in later:
        assert drafts == reference.drafts(context, 3)[:k], f"context of {len(context)} tokens"


def test_users_arriving_together_with_one_system_prompt_restore_it(ckpt: Path) -> None:
    """The first computes the shared system prompt; the others wait a step and restore it (a hybrid
    hit needs the state, which exists only once that step ran), then compute their own questions."""
    system = words(333, 8)
    users = [system + words(15, 200 + u) for u in range(4)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    engine = make_engine(ckpt)
    got = engine.generate(users, params)
    cached = [r.outputs[0][-1].num_cached_tokens for r in got]
    assert cached[0] == 0 and min(cached[1:]) >= 0.9 * len(system), cached
    want = make_engine(ckpt, enable_prefix_caching=False).generate(users, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
