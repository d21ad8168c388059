"""Speculative decoding (n-gram drafts): the same greedy and seeded outputs as without it, under
concurrency, preemption, stop strings, logprobs, max_tokens and aborts; the sampled distribution
kept (a statistical test of the verification rule on a tiny vocabulary); the KV pages of
rejected drafts returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.spec_decode import record_steps
from engine.config import EngineConfig
from engine.core_types import EngineCoreOutputs
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.sampler import Sampler
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.rejection import verify
from scheduler.request import SamplingParams
from scheduler.structured_output import StructuredOutput
from tests.factories import make_hybrid_checkpoint


def make_engine(path: Path, **overrides: Any) -> OfflineEngine:
    kwargs: dict[str, Any] = dict(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    kwargs.update(overrides)
    return OfflineEngine.from_config(EngineConfig(**kwargs))


def spec_engine(path: Path, **overrides: Any) -> tuple[OfflineEngine, list[EngineCoreOutputs]]:
    """An n-gram engine whose step outputs are recorded (for the acceptance counts)."""
    overrides = {"speculative_max_batch": 8, **overrides}  # every test batch speculates unless told
    engine = make_engine(path, speculative_method="ngram", num_speculative_tokens=4, **overrides)
    steps = record_steps(engine)
    return engine, steps


def num_accepted(steps: list[EngineCoreOutputs]) -> int:
    return sum(sum(s.num_accepted_by_position) for s in steps)


def prompts() -> list[list[int]]:
    """Repetitive prompts (drafts get accepted) and a random one, of several lengths."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 500, (12,), generator=g).tolist()
    return [
        base * 4,
        base[:5] * 6,
        torch.randint(0, 500, (30,), generator=g).tolist(),
        base[3:] * 3 + [5, 6],
        torch.randint(0, 500, (17,), generator=g).tolist() * 2,
        base[:2] * 9,
    ]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def oracle_drafter(ref: list[Any]) -> Any:
    """A drafter that knows the reference outputs (OfflineResults) and proposes them with one token
    corrupted at a position that varies with the output length (sometimes none): full
    acceptances, partial ones and rejections."""
    truth = {tuple(r.prompt_token_ids): r.token_ids[0] for r in ref}

    def propose(request_id: str, context: list[int], k: int) -> list[int]:
        prompt = next(p for p in truth if tuple(context[: len(p)]) == p)
        done = len(context) - len(prompt)
        draft = list(truth[prompt][done : done + k])
        bad = done % (k + 2)  # k or k + 1: the whole draft is right
        if bad < len(draft):
            draft[bad] = (draft[bad] + 1) % 500
        return draft

    return propose


# ---- the drafter ---------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer(2, 3)
    assert p.lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # latest 3-gram match
    assert p.lookup([7, 8, 9, 7, 8], 4) == [9, 7, 8]  # runs into the suffix itself
    assert p.lookup([1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert NgramProposer(1, 1).lookup([4, 1, 4], 2) == [1, 4]


# ---- greedy: exact -------------------------------------------------------------------------------
@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "llama_ckpt"])
def test_greedy_output_is_unchanged_under_concurrency(ckpt: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(ckpt)
    params = [
        GREEDY,
        GREEDY,
        GREEDY,
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative=False),
        GREEDY,
    ]
    ref = make_engine(path).generate(prompts(), params)
    engine, steps = spec_engine(path)
    assert engine.core.scheduler.config.speculative_adaptive, "adaptive draft lengths are the CPU default"
    got = engine.generate(prompts(), params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [len(r.token_ids[0]) for r in got] == [40, 40, 40, 9, 40, 40]
    assert num_accepted(steps) > 20, "the repetitive prompts must get drafts accepted"
    assert any(len(o.new_token_ids) > 1 for r in got for o in r.outputs[0]), "several tokens in one step"
    opted_out = got[4].outputs[0]
    assert all(len(o.new_token_ids) == 1 for o in opted_out), "speculative=False drafts nothing"
    bm = engine.core.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_greedy_output_is_unchanged_with_preemption(qwen3_ckpt: Path) -> None:
    # 12 pages of 16 tokens for six requests of up to 94 tokens: requests are preempted and resume.
    ref = make_engine(qwen3_ckpt, kv_cache_memory="96KiB").generate(prompts(), GREEDY)
    engine, steps = spec_engine(qwen3_ckpt, kv_cache_memory="96KiB", speculative_adaptive=False)
    assert not engine.core.scheduler.config.speculative_adaptive
    got = engine.generate(prompts(), GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert engine.core.scheduler.num_preemptions > 0
    assert num_accepted(steps) > 0
    assert engine.core.scheduler.block_manager.num_used_blocks == 0


def test_speculation_stops_above_the_batch_limit(qwen3_ckpt: Path) -> None:
    engine, steps = spec_engine(qwen3_ckpt, speculative_max_batch=2)
    # Six requests running: no drafts until only the two longest are left.
    engine.generate(
        prompts(), [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (5, 8, 10, 12, 40, 40)]
    )
    drafted = [s for s in steps if s.num_drafts_by_position]
    assert drafted and all(s.num_batched_requests <= 2 for s in drafted)


# ---- sampling: the same distribution, the same seeded draws -----------------------------------------
def test_seeded_sampling_is_unchanged(qwen3_ckpt: Path) -> None:
    """Noise is keyed on (seed, output position): a seeded request draws the same tokens."""
    params = [SamplingParams(max_tokens=30, temperature=0.3, seed=100 + i, ignore_eos=True) for i in range(6)]
    ref = make_engine(qwen3_ckpt).generate(prompts(), params)
    engine, steps = spec_engine(qwen3_ckpt)
    got = engine.generate(prompts(), params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert num_accepted(steps) > 0


def test_verification_keeps_the_target_distribution() -> None:
    """Vocabulary of 4, one draft token per request: the first emitted token follows p0 whatever
    the draft, and after an accepted draft the second follows p1 (the joint law of sampling twice)."""
    vocab, n = 4, 20000
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sampler = Sampler(vocab, torch.device("cpu"))
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        sampler.add_request(rid, SamplingParams(temperature=1.0), [0], [])
    rows = torch.stack([p0.log(), p1.log()]).repeat(n, 1)  # [2n, 4]: request i's rows 2i, 2i + 1
    draft = 1
    torch.manual_seed(0)
    emitted = verify(sampler, None, rows, ids, [[draft]] * n)
    first = torch.tensor([e[0].token_id for e in emitted])
    freq0 = torch.bincount(first, minlength=vocab).double() / n
    assert (freq0 - p0.double()).abs().max() < 4 * (0.25 / n) ** 0.5, freq0
    assert all(len(e) == (2 if e[0].token_id == draft else 1) for e in emitted)
    second = torch.tensor([e[1].token_id for e in emitted if len(e) == 2])
    freq1 = torch.bincount(second, minlength=vocab).double() / len(second)
    assert (freq1 - p1.double()).abs().max() < 4 * (0.25 / len(second)) ** 0.5, freq1


# ---- several tokens per step: stop strings, logprobs, aborts ------------------------------------------
def test_stop_strings_and_logprobs_with_several_tokens_per_step(qwen3_ckpt: Path) -> None:
    base = make_engine(qwen3_ckpt).generate(prompts()[:2], GREEDY)
    # A word from the middle of each greedy output, and max_tokens inside a draft window.
    stops = [base[0].texts[0].split()[17], base[1].texts[0].split()[23]]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stops[0],), logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stops[1],)),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=0),
    ]
    ps = prompts()[:2] + [prompts()[0]]
    ref = make_engine(qwen3_ckpt).generate(ps, params)
    engine, steps = spec_engine(qwen3_ckpt)
    got = engine.generate(ps, params)
    assert num_accepted(steps) > 0
    for a, b in zip(got, ref):
        assert a.texts == b.texts and a.finish_reasons == b.finish_reasons
        assert [o.stop_reason for o in a.outputs[0]][-1] == [o.stop_reason for o in b.outputs[0]][-1]
    assert got[0].finish_reasons == ["stop"] and got[2].finish_reasons == ["length"]
    for a, b in ((got[0], ref[0]), (got[2], ref[2])):
        la = [lp for o in a.outputs[0] for lp in (o.logprobs or ())]
        lb = [lp for o in b.outputs[0] for lp in (o.logprobs or ())]
        assert [x.token_id for x in la] == [x.token_id for x in lb]
        assert [[t.token_id for t in x.top] for x in la] == [[t.token_id for t in x.top] for x in lb]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(la, lb)) < 1e-4
    assert len([lp for o in got[2].outputs[0] for lp in (o.logprobs or ())]) == 13


def test_abort_while_speculating_frees_everything(qwen3_ckpt: Path) -> None:
    engine, steps = spec_engine(qwen3_ckpt)
    ids = [engine.add_request(p, GREEDY) for p in prompts()]
    for _ in range(8):
        engine.step()
    assert num_accepted(steps) > 0
    engine.abort(ids[0])
    engine.abort(ids[3])
    engine.core.scheduler.block_manager.check_invariants()
    while engine.has_unfinished():
        engine.step()
    bm = engine.core.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0


# ---- configuration ------------------------------------------------------------------------------------
def test_mtp_and_bad_ngram_ranges_are_refused(qwen3_ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="mtp"):
        make_engine(qwen3_ckpt, speculative_method="mtp")
    with pytest.raises(ConfigError, match="ngram-min"):
        make_engine(qwen3_ckpt, speculative_method="ngram", ngram_min=3, ngram_max=2)


# ---- hybrids: the DeltaNet state rolls back -------------------------------------------------------------
def test_hybrid_greedy_output_is_unchanged(tmp_path: Path) -> None:
    """Rejected drafts put the Gated DeltaNet state back and recompute (engine/spec_decode/rollback.py).

    A random hybrid rarely repeats itself, so an oracle drafter proposes the reference continuation."""
    hybrid = make_hybrid_checkpoint(tmp_path / "hybrid")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 30, 30, 9, 30, 30)]
    ref = make_engine(hybrid, enable_prefix_caching=False).generate(prompts(), params)
    engine, steps = spec_engine(hybrid, enable_prefix_caching=False)
    engine.core.scheduler.drafter = oracle_drafter(ref)
    got = engine.generate(prompts(), params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    drafted = sum(sum(s.num_drafts_by_position) for s in steps)
    accepted_last = sum(s.num_accepted_by_position[-1] for s in steps if s.num_accepted_by_position)
    assert 0 < accepted_last and num_accepted(steps) < drafted, "full acceptances and rollbacks both happen"


# ---- the scheduler: pages for drafts, returned on rejection ---------------------------------------------
def test_draft_pages_are_reserved_and_rejected_ones_returned() -> None:
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.factories import make_request

    config = SchedulerConfig(block_size=4, num_blocks=10, num_speculative_tokens=4, speculative_max_batch=4)
    sched = Scheduler(config, drafter=lambda request_id, context, k: [1, 2, 3, 4, 5][:k])
    sched.add_request(make_request("r", [10, 11, 12, 13], max_tokens=20))
    out = sched.schedule()
    sched.update(out, {"r": 9})  # the prompt filled page 0; 5 tokens now
    out = sched.schedule()
    [sr] = out.requests
    assert sr.token_ids == (9, 1, 2, 3, 4) and sr.num_draft_tokens == 4 and sr.start_pos == 4
    assert len(sr.block_table) == 3  # positions 4..8: pages 1 and 2 held for the drafts
    free_before = sched.block_manager.num_free_blocks
    [request] = sched.update(out, {"r": [1, 7]})  # draft 1 accepted, 2 rejected: 7 emitted instead
    assert request.output_token_ids == [9, 1, 7] and request.num_computed_tokens == 6
    assert len(request.block_table) == 2 and sched.block_manager.num_free_blocks == free_before + 1
    assert sched.block_manager.cached == {
        sched.block_manager.block_hash[request.block_table[0]]: request.block_table[0]
    }
    out = sched.schedule()  # drafts again from the accepted state: 20 - 3 tokens left
    assert out.requests[0].token_ids[0] == 7 and out.requests[0].start_pos == 6


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
def test_adaptive_draft_length_follows_acceptance(adaptive: bool) -> None:
    """After a rejection the request asks for one draft more than were accepted, after a full
    acceptance for twice as many, never more than K; without the setting always K."""
    from scheduler.scheduler import Scheduler, SchedulerConfig, next_draft_len
    from tests.factories import make_request

    asked: list[int] = []

    def drafter(request_id: str, context: Any, k: int) -> list[int]:
        asked.append(k)
        return [1, 2, 3, 4, 5, 6][:k]

    config = SchedulerConfig(
        block_size=4, num_blocks=40, num_speculative_tokens=6, speculative_max_batch=4, speculative_adaptive=adaptive
    )
    sched = Scheduler(config, drafter=drafter)
    sched.add_request(make_request("r", [10, 11, 12, 13], max_tokens=60))
    sched.update(sched.schedule(), {"r": 9})
    # (tokens emitted by each verify step): 1 of 6 drafts accepted, then all 2, all 4, 0 of 6, all 1
    for emitted in ([1, 7], [1, 2, 8], [1, 2, 3, 4, 8], [8], [1, 8]):
        out = sched.schedule()
        assert out.requests[0].num_draft_tokens == asked[-1]
        sched.update(out, {"r": emitted[: asked[-1] + 1]})
    sched.schedule()
    assert asked == ([6, 2, 4, 6, 1, 2] if adaptive else [6] * 6)
    assert next_draft_len(current=6, drafted=3, accepted=3, most=6) == 6  # a short match fully accepted keeps K


# ---- grammar-constrained requests: the mask applies at every verification position ----------------------
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_constrained_requests_keep_their_output(sampling: dict[str, Any]) -> None:
    grammars = [
        'root ::= "{\\"n\\": " [0-9]{1,4} ", \\"ok\\": " ( "true" | "false" ) "}"',
        'root ::= "The answer is " [1-9] [0-9]{0,2} "."',
    ]
    config = dict(kv_cache_memory="512KiB", block_size=16, dtype="float32")
    ref_engine = OfflineEngine.from_config(EngineConfig(**config))
    ps = [ref_engine.tokenizer.encode(t, add_special_tokens=False) for t in ("Hello there", "Write a number")]
    params = [SamplingParams(max_tokens=40, structured=StructuredOutput.ebnf(g), **sampling) for g in grammars]
    ref = ref_engine.generate(ps, params)
    engine = OfflineEngine.from_config(EngineConfig(**config, speculative_method="ngram", speculative_max_batch=8))
    steps = record_steps(engine)
    engine.core.scheduler.drafter = oracle_drafter(ref)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.finish_reasons for r in got] == [["stop"], ["stop"]]
    assert [r.texts for r in got] == [r.texts for r in ref], "tokens accepted with the stop token are text"
    assert 0 < num_accepted(steps) < sum(sum(s.num_drafts_by_position) for s in steps)


# ---- beside the other features: prompt logprobs and fair-share accounting ------------------------
def test_prompt_logprobs_of_a_prefill_beside_verifying_steps(qwen3_ckpt: Path) -> None:
    """A verifying step is a decode (no prompt chunk of its own), but a long prompt prefilling in
    the same batches still gets every prompt logprob, as without speculation."""
    g = torch.Generator().manual_seed(11)
    long_prompt = torch.randint(0, 500, (90,), generator=g).tolist()
    ps = [prompts()[0], long_prompt]
    asking = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    params = [GREEDY, asking]
    ref = make_engine(qwen3_ckpt, max_num_batched_tokens=16).generate(ps, params)
    engine, steps = spec_engine(qwen3_ckpt, max_num_batched_tokens=16)
    engine.core.scheduler.drafter = oracle_drafter(ref)
    got = engine.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert num_accepted(steps) > 0
    assert any(s.num_drafts_by_position and any(o.prompt_logprobs for o in s.outputs) for s in steps), (
        "a step verified drafts and scored prompt tokens together"
    )
    want, have = ref[1].outputs[0][0].prompt_logprobs, got[1].outputs[0][0].prompt_logprobs
    assert have is not None and want is not None and len(have) == len(long_prompt)
    assert have[0] is None and want[0] is None
    assert [e.token_id for e in have[1:] if e] == [e.token_id for e in want[1:] if e] == long_prompt[1:]
    # Other batch neighbours change the float sums a little.
    assert [e.logprob for e in have[1:] if e] == pytest.approx([e.logprob for e in want[1:] if e], abs=1e-3)
    assert got[0].outputs[0][0].prompt_logprobs is None


def test_fair_share_is_charged_for_drafts() -> None:
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.factories import make_request

    config = SchedulerConfig(
        block_size=4, num_blocks=10, num_speculative_tokens=4, speculative_max_batch=4, scheduling_policy="fair"
    )
    sched = Scheduler(config, drafter=lambda request_id, context, k: [1, 2, 3, 4, 5][:k])
    request = make_request("r", [10, 11, 12, 13], max_tokens=20)
    sched.add_request(request)
    sched.update(sched.schedule(), {"r": 9})
    assert sched.fair.served[request.key] == 4
    out = sched.schedule()
    assert out.requests[0].num_draft_tokens == 4
    assert sched.fair.served[request.key] == 4 + 1 + 4  # the real token and its four drafts
    sched.update(out, {"r": [1, 7]})
    sched.abort_request("r")
    assert request.key not in sched.fair._active and not sched.requests  # on_remove ran once
