"""The batched sampler: processors on fixed logits with hand-computed results, greedy and
filtered sampling, seeded reproducibility across batches, raw logprobs, request state."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from engine.core_types import SampledToken
from engine.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, draw_inverse_cdf
from scheduler.request import SamplingParams

CPU = torch.device("cpu")
NEG_INF = -math.inf


def make_sampler(vocab_size: int = 6) -> Sampler:
    return Sampler(vocab_size, CPU)


def add(
    sampler: Sampler,
    request_id: str,
    prompt: Sequence[int] = (0,),
    eos: Sequence[int] = (),
    **params: object,
) -> None:
    sampler.add_request(request_id, SamplingParams(**params), prompt, eos)


def forcing_logits(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(token_ids), V] logits that can only sample token_ids[i] in row i, whatever the params."""
    logits = torch.full((len(token_ids), vocab_size), NEG_INF)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 0.0
    return logits


def force(sampler: Sampler, request_id: str, token_ids: Sequence[int]) -> None:
    """Give a request a known output history, one step per token."""
    for token_id in token_ids:
        out = sampler.sample(forcing_logits([token_id], sampler.vocab_size), [request_id])
        assert out[0].token_id == token_id


def step_logits(num_steps: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_steps, vocab_size, generator=generator)  # [steps, V]


def tokens(out: list[SampledToken]) -> list[int]:
    return [t.token_id for t in out]


# --- processors on fixed logits --------------------------------------------------------------


def test_apply_penalties_matches_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, -0.5, 3.0]])
    counts = torch.tensor([[0, 0, 0, 2, 1, 0]], dtype=torch.int32)  # outputs 3, 3, 4
    prompt_mask = torch.tensor([[False, True, True, False, False, False]])  # prompt 1, 2
    out = apply_penalties(logits, counts, prompt_mask, torch.tensor([0.25]), torch.tensor([0.5]), torch.tensor([2.0]))
    # 1: prompt, negative -> *2; 2: prompt, positive -> /2; 3: 0.5/2 - 0.5*2 - 0.25;
    # 4: -0.5*2 - 0.5*1 - 0.25; 0 and 5 unseen.
    assert out.tolist() == [[2.0, -2.0, 0.75, -1.0, -1.75, 3.0]]
    assert logits.tolist() == [[2.0, -1.0, 1.5, 0.5, -0.5, 3.0]], "penalties must not write the input"


def test_process_logits_after_known_history_applies_all_penalties() -> None:
    sampler = make_sampler()
    add(sampler, "r", prompt=(1, 2), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    force(sampler, "r", [3, 3, 4])
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, -0.5, 3.0]])
    assert sampler.process_logits(logits, ["r"]).tolist() == [[2.0, -2.0, 0.75, -1.0, -1.75, 3.0]]
    assert logits.tolist() == [[2.0, -1.0, 1.5, 0.5, -0.5, 3.0]]


def test_frequency_and_presence_count_outputs_only() -> None:
    sampler = make_sampler()
    add(sampler, "r", prompt=(1, 1, 2), frequency_penalty=1.0, presence_penalty=0.5)
    force(sampler, "r", [2, 5, 5])
    logits = torch.zeros(1, 6)
    # Prompt-only token 1 untouched; 2: 1 output; 5: 2 outputs.
    assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, 0.0, -1.5, 0.0, 0.0, -2.5]]


def test_repetition_penalty_counts_prompt_and_output_tokens() -> None:
    sampler = make_sampler()
    add(sampler, "r", prompt=(0,), repetition_penalty=1.25)
    force(sampler, "r", [4])
    logits = torch.tensor([[2.5, 2.5, -2.5, 1.0, -5.0, 1.0]])
    assert sampler.process_logits(logits, ["r"]).tolist() == [[2.0, 2.5, -2.5, 1.0, -6.25, 1.0]]


def test_logit_bias_is_added_before_penalties() -> None:
    sampler = make_sampler()
    add(sampler, "r", prompt=(3,), logit_bias={3: -1.0, 5: 2.5}, repetition_penalty=2.0)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.0, 1.0]])
    # 3: 0.5 - 1.0 = -0.5, then repetition (negative) * 2 = -1.0; the other order gives -0.75.
    assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, 0.0, 0.0, -1.0, 0.0, 3.5]]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_then_releases_them(ignore_eos: bool) -> None:
    sampler = make_sampler()
    add(sampler, "r", eos=(5,), min_tokens=2, stop_token_ids=(4,), ignore_eos=ignore_eos, temperature=0.0)
    logits = torch.arange(6, dtype=torch.float32)[None, :]
    masked_eos = 5.0 if ignore_eos else NEG_INF  # ignore_eos: EOS is no stop, so not masked
    for _ in range(2):
        assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, 1.0, 2.0, 3.0, NEG_INF, masked_eos]]
        assert tokens(sampler.sample(logits, ["r"])) == [5 if ignore_eos else 3]
    assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert tokens(sampler.sample(logits, ["r"])) == [5]


def test_processors_apply_per_row_in_a_mixed_batch() -> None:
    sampler = make_sampler()
    add(sampler, "plain")
    add(sampler, "bias", logit_bias={0: 10.0})
    add(sampler, "pen", prompt=(2,), presence_penalty=1.0, repetition_penalty=2.0)
    force(sampler, "pen", [1])
    logits = torch.ones(3, 6)
    assert sampler.process_logits(logits, ["bias", "pen", "plain"]).tolist() == [
        [11.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [1.0, -0.5, 0.5, 1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    ]


def test_apply_top_k_top_p_masks_exact_tokens() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log()[None, :].repeat(4, 1)
    top_k = torch.tensor([2, 0, 0, 3])
    top_p = torch.tensor([1.0, 0.7, 0.85, 0.9])
    kept = apply_top_k_top_p(logits, top_k, top_p) > NEG_INF
    assert kept.tolist() == [
        [False, True, False, True],  # top-2
        [False, True, False, True],  # 0.5 + 0.3 >= 0.7
        [True, True, False, True],  # 0.8 < 0.85: one more
        [True, True, False, True],  # top-3 renormalized: 0.53 + 0.32 < 0.9, all three
    ]
    assert (apply_top_k_top_p(logits, top_k, None) > NEG_INF).sum(dim=-1).tolist() == [2, 4, 4, 3]


def test_apply_min_p_drops_tokens_below_fraction_of_top_prob() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    out = apply_min_p(logits, torch.tensor([0.5, 0.45]))
    assert (out > NEG_INF).tolist() == [[True, True, False], [True, True, False]]
    assert torch.equal(out[:, :2], logits[:, :2])
    assert (apply_min_p(logits, torch.tensor([0.61, 0.39])) > NEG_INF).tolist() == [
        [True, False, False],
        [True, True, True],
    ]


# --- greedy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"top_k": 1}, {"temperature": 1e-7}])
@pytest.mark.parametrize("num_rows", [1, 7])
def test_greedy_rows_equal_argmax_and_repeat(params: dict[str, float], num_rows: int) -> None:
    sampler = make_sampler(vocab_size=50)
    ids = [f"r{i}" for i in range(num_rows)]
    for rid in ids:
        add(sampler, rid, **params)
    logits = step_logits(num_rows, 50, seed=3)
    first = tokens(sampler.sample(logits, ids))
    assert first == logits.argmax(dim=-1).tolist()
    assert tokens(sampler.sample(logits, ids)) == first


def test_greedy_ties_take_the_lowest_id() -> None:
    sampler = make_sampler()
    add(sampler, "r", temperature=0.0)
    assert tokens(sampler.sample(torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]]), ["r"])) == [1]


def test_greedy_takes_argmax_of_processed_logits_beside_random_rows() -> None:
    sampler = make_sampler()
    add(sampler, "g", temperature=0.0, logit_bias={2: 5.0})
    add(sampler, "s", seed=0)
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0, 0.0], [NEG_INF] * 5 + [0.0]])
    assert tokens(sampler.sample(logits, ["g", "s"])) == [2, 5]


# --- filtered sampling (many draws, one row per request; seeded so the counts are fixed) ----------


def draw_many(vocab_size: int, logits_row: torch.Tensor, num_draws: int, **params: object) -> Counter[int]:
    sampler = make_sampler(vocab_size)
    ids = [f"r{i}" for i in range(num_draws)]
    for i, rid in enumerate(ids):
        add(sampler, rid, seed=i, **params)
    return Counter(tokens(sampler.sample(logits_row[None, :].repeat(num_draws, 1), ids)))


def test_top_k_only_ever_draws_the_k_highest() -> None:
    logits = torch.tensor([0.0, 1.9, -1.0, 2.0, 0.5, 1.8, 1.0, -3.0])
    drawn = draw_many(8, logits, 600, top_k=3)
    assert set(drawn) == {1, 3, 5}


def test_top_p_point_seven_draws_ids_zero_and_one_in_ratio() -> None:
    drawn = draw_many(4, torch.tensor([0.5, 0.3, 0.15, 0.05]).log(), 2000, top_p=0.7)
    assert set(drawn) == {0, 1}
    assert 0.57 < drawn[0] / 2000 < 0.68  # 0.5 / 0.8 = 0.625


def test_top_p_point_eight_five_draws_ids_zero_to_two() -> None:
    drawn = draw_many(4, torch.tensor([0.5, 0.3, 0.15, 0.05]).log(), 2000, top_p=0.85)
    assert set(drawn) == {0, 1, 2}


def test_min_p_half_drops_the_token_below_a_quarter() -> None:
    drawn = draw_many(3, torch.tensor([0.5, 0.3, 0.2]).log(), 1000, min_p=0.5)
    assert set(drawn) == {0, 1}
    assert 0.57 < drawn[0] / 1000 < 0.68  # 0.5 / 0.8


def test_temperature_sharpens_the_distribution() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    cold = draw_many(3, logits, 1000, temperature=0.25)  # p^4 renormalized: 0.5 -> 0.85
    assert 0.80 < cold[0] / 1000 < 0.93


# --- seeds -----------------------------------------------------------------------------------

SEEDED_CASES = [{}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.05, "presence_penalty": 0.5, "temperature": 0.7}]


def run_seeded(row: int, neighbours: list[dict[str, object]], params: dict[str, object]) -> list[int]:
    """Sample the seeded request "s" for 20 steps at `row` of a batch among `neighbours`."""
    vocab_size, num_steps = 64, 20
    sampler = make_sampler(vocab_size)
    ids = [f"n{i}" for i in range(len(neighbours))]
    for rid, neighbour in zip(ids, neighbours):
        add(sampler, rid, **neighbour)
    ids.insert(row, "s")
    add(sampler, "s", prompt=(1, 2, 3), seed=1234, **params)
    mine = step_logits(num_steps, vocab_size, seed=7)
    others = step_logits(num_steps * len(ids), vocab_size, seed=row + 100).view(num_steps, len(ids), -1)
    sequence = []
    for step in range(num_steps):
        logits = others[step].clone()
        logits[row] = mine[step]
        sequence.append(tokens(sampler.sample(logits, ids))[row])
    return sequence


@pytest.mark.parametrize("params", SEEDED_CASES)
def test_seeded_request_is_reproducible_across_batches_and_rows(params: dict[str, object]) -> None:
    alone = run_seeded(0, [], params)
    assert len(set(alone)) > 3, "a seeded request must still vary from position to position"
    batch_a = [{}, {"temperature": 0.0}, {"seed": 5, "top_k": 3}, {"frequency_penalty": 1.0}]
    batch_b = [{"seed": 99}, {"top_p": 0.5}, {"temperature": 0.0, "logit_bias": {0: 3.0}}, {}, {"min_p": 0.2}]
    assert run_seeded(0, batch_a, params) == alone
    assert run_seeded(3, batch_b, params) == alone


def test_different_seeds_give_different_sequences() -> None:
    sampler = make_sampler(64)
    add(sampler, "a", seed=1)
    add(sampler, "b", seed=2)
    add(sampler, "c", seed=1)
    out = [tokens(sampler.sample(torch.zeros(3, 64), ["a", "b", "c"])) for _ in range(30)]
    a, b, c = ([row[i] for row in out] for i in range(3))
    assert a == c
    assert len(set(a)) > 10, "the noise must depend on the output position"
    assert sum(x != y for x, y in zip(a, b)) > 20


def test_unseeded_rows_vary() -> None:
    sampler = make_sampler(64)
    add(sampler, "a")
    add(sampler, "b")
    out = [tokens(sampler.sample(torch.zeros(2, 64), ["a", "b"])) for _ in range(30)]
    a, b = [row[0] for row in out], [row[1] for row in out]
    assert len(set(a)) > 10
    assert sum(x != y for x, y in zip(a, b)) > 20


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_at_sampled_id_and_top_n(dtype: torch.dtype) -> None:
    vocab_size = 40
    sampler = make_sampler(vocab_size)
    add(sampler, "none")
    add(sampler, "zero", logprobs=0, temperature=0.0)
    add(sampler, "five", logprobs=5, temperature=0.5, logit_bias={7: 30.0}, presence_penalty=1.0)
    add(sampler, "two", logprobs=2, top_k=3, seed=4)
    logits = step_logits(4, vocab_size, seed=11).to(dtype)
    out = sampler.sample(logits, ["none", "zero", "five", "two"])
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out[0].logprob is None and out[0].top_ids == ()
    assert out[1].logprob == pytest.approx(raw[1, out[1].token_id].item(), abs=1e-6)
    assert out[1].top_ids == ()
    assert out[2].token_id == 7  # sampled from the biased logits, reported from the raw ones
    for row, n in [(2, 5), (3, 2)]:
        expected = raw[row].topk(n)
        assert out[row].logprob == pytest.approx(raw[row, out[row].token_id].item(), abs=1e-6)
        assert list(out[row].top_ids) == expected.indices.tolist()
        assert list(out[row].top_logprobs) == pytest.approx(expected.values.tolist(), abs=1e-6)


def test_sample_does_not_write_the_input_logits() -> None:
    sampler = make_sampler()
    add(sampler, "r", min_tokens=1, logit_bias={1: 2.0}, repetition_penalty=1.5, top_p=0.5, eos=(5,))
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    sampler.sample(logits, ["r"])
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]


# --- request state ---------------------------------------------------------------------------


def test_remove_request_frees_state_and_a_reused_id_starts_fresh() -> None:
    sampler = make_sampler()
    add(sampler, "r", eos=(5,), min_tokens=2, frequency_penalty=1.0)
    force(sampler, "r", [1, 1])
    logits = torch.zeros(1, 6)
    assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, -2.0, 0.0, 0.0, 0.0, 0.0]]
    sampler.remove_request("r")
    sampler.remove_request("r")  # idempotent
    sampler.remove_request("never-added")
    with pytest.raises(AssertionError):
        sampler.sample(logits, ["r"])
    add(sampler, "r", eos=(5,), min_tokens=2, frequency_penalty=1.0)
    assert sampler.process_logits(logits, ["r"]).tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, NEG_INF]]


@pytest.mark.parametrize("num_requests", [1, 8, 9, 20])
def test_penalty_state_is_per_request_across_pool_growth_and_slot_reuse(num_requests: int) -> None:
    vocab_size = 24
    sampler = make_sampler(vocab_size)
    ids = [f"r{i}" for i in range(num_requests)]
    for i, rid in enumerate(ids):
        add(sampler, rid, prompt=(i,), frequency_penalty=1.0)
    history = [[(i + step) % vocab_size for i in range(num_requests)] for step in range(3)]
    for step_tokens in history:
        assert tokens(sampler.sample(forcing_logits(step_tokens, vocab_size), ids)) == step_tokens
    expected = torch.zeros(num_requests, vocab_size)
    for step_tokens in history:
        expected[torch.arange(num_requests), torch.tensor(step_tokens)] -= 1.0
    assert torch.equal(sampler.process_logits(torch.zeros(num_requests, vocab_size), ids), expected)
    sampler.remove_request(ids[0])
    add(sampler, "new", prompt=(0,), frequency_penalty=1.0)  # takes the freed slot
    assert sampler.process_logits(torch.zeros(1, vocab_size), ["new"]).tolist() == [[0.0] * vocab_size]


def test_empty_step_returns_nothing() -> None:
    assert make_sampler().sample(torch.zeros(0, 6), []) == []


# --- the two-level inverse-CDF draw ------------------------------------------------------------


@pytest.mark.parametrize("vocab_size,block_size", [(1000, 256), (1024, 256), (7, 4), (5, 8)])
def test_two_level_draw_picks_the_bucket_a_full_cumsum_picks(vocab_size: int, block_size: int) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(64, vocab_size, generator=generator) * 3
    logits[logits < -1.0] = NEG_INF  # masked tokens: empty buckets, in runs that span blocks
    probs = logits.softmax(dim=-1)  # [R, V]
    u = torch.rand(64, 1, generator=generator)
    u[0], u[1] = 0.0, math.nextafter(1.0, 0.0)  # both ends
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)[:, 0].clamp(max=vocab_size - 1)
    drawn = draw_inverse_cdf(probs, u, block_size)
    assert bool((probs.gather(1, drawn[:, None]) > 0).all()), "a masked token was drawn"
    # Bucket edges computed in float32 two ways may differ by rounding: only a row whose u sits
    # within 1e-5 of an edge may disagree, and then by one neighbouring live token.
    near_edge = ((cdf - u.double() * cdf[:, -1:]).abs() < 1e-5).any(dim=-1)
    assert torch.equal(drawn[~near_edge], expected[~near_edge])


def test_two_level_draw_never_takes_a_zero_probability_token_at_the_ends() -> None:
    probs = torch.zeros(2, 600)
    probs[:, 300] = 0.25
    probs[:, 599 - 80] = 0.75  # the last live token is not the vocabulary's last
    for u in (0.0, 0.2499, 0.25, math.nextafter(1.0, 0.0)):
        drawn = draw_inverse_cdf(probs, torch.full((2, 1), u), 256).tolist()
        assert drawn == [300, 300] if u < 0.25 else drawn == [519, 519], (u, drawn)


def test_two_level_draw_follows_the_distribution() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.3, 0.0, 0.0, 0.6, 0.0]]).expand(20000, 7).contiguous()
    drawn = draw_inverse_cdf(probs, torch.rand(20000, 1, generator=torch.Generator().manual_seed(0)), 2)
    counts = torch.bincount(drawn, minlength=7).float() / 20000
    assert counts[[1, 3, 4, 6]].sum() == 0
    assert counts[[0, 2, 5]].tolist() == pytest.approx([0.1, 0.3, 0.6], abs=0.015)


def test_rows_all_capped_by_top_k_take_a_partial_selection_not_a_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.sampler as sampler_module

    seen: list[int | None] = []
    real = sampler_module.apply_top_k_top_p

    def spy(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int | None = None):
        seen.append(max_top_k)
        return real(logits, top_k, top_p, max_top_k)

    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", spy)
    sampler = make_sampler(vocab_size=1000)
    add(sampler, "a", temperature=0.6, top_k=20, top_p=0.95, seed=1)
    add(sampler, "b", temperature=1.0, top_k=5, seed=2)
    logits = step_logits(2, 1000, seed=4)
    drawn = tokens(sampler.sample(logits, ["a", "b"]))
    assert seen == [20]  # the largest cap: a top-20 selection, no sort of the 1,000 logits
    assert drawn[0] in logits[0].topk(20).indices.tolist() and drawn[1] in logits[1].topk(5).indices.tolist()
    add(sampler, "c", temperature=1.0, top_p=0.9, seed=3)  # top-p alone: it needs the whole order
    sampler.sample(step_logits(3, 1000, seed=5), ["a", "b", "c"])
    assert seen[-1] is None
