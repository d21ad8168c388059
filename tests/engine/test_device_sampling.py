"""engine/device_sampling.py: the static-shape, sync-free sampler. Greedy rows are bit-identical to
the Sampler's; random rows follow the same processors' distribution; the noise is a pure function
of (seed, position, token)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.device_sampling import SamplingTensors, apply_min_p, apply_top_k_top_p, race_noise, sample_static
from engine.sampler import Sampler
from scheduler.request import SamplingParams

V = 64


def tensors(rows: list[SamplingParams], seeds: list[int] | None = None, position: int = 0) -> SamplingTensors:
    f = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    return SamplingTensors(
        temperature=f([p.temperature for p in rows]),
        top_k=torch.tensor([p.top_k for p in rows]),
        top_p=f([p.top_p for p in rows]),
        min_p=f([p.min_p for p in rows]),
        presence=f([p.presence_penalty for p in rows]),
        frequency=f([p.frequency_penalty for p in rows]),
        repetition=f([p.repetition_penalty for p in rows]),
        seed=torch.tensor(seeds if seeds is not None else [p.seed or 0 for p in rows]),
        position=torch.full((len(rows),), position, dtype=torch.int64),
    )


def test_greedy_rows_are_bit_identical_to_the_sampler_penalties_included() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0.9, top_k=1),
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2),
    ]
    sampler = Sampler(V, torch.device("cpu"))
    ids = [f"r{i}" for i in range(len(rows))]
    for rid, p in zip(ids, rows):
        sampler.add_request(rid, p, [3, 4, 5], ())
    for _ in range(4):  # the penalty rows' counts grow with each step's token
        logits = torch.randn(len(rows), V, generator=g)
        counts = torch.zeros(len(rows), V, dtype=torch.int32)
        prompt = torch.zeros(len(rows), V, dtype=torch.bool)
        slot = sampler._states["r1"].penalty_slot  # noqa: SLF001 - the Sampler's own penalty state
        counts[1], prompt[1] = sampler._output_counts[slot], sampler._prompt_mask[slot]  # noqa: SLF001
        got = sample_static(logits, tensors(rows), (counts, prompt))
        want = [t.token_id for t in sampler.sample(logits, ids)]
        assert got.tolist() == want


def test_random_rows_follow_the_processed_distribution() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 2
    p = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05)
    num = 20000
    rows = [p] * num
    drawn = sample_static(logits.expand(num, V), tensors(rows, seeds=list(range(num))))
    x = apply_top_k_top_p(logits / 0.7, torch.tensor([12]), torch.tensor([0.9]))
    expected = apply_min_p(x, torch.tensor([0.05])).softmax(-1)[0]
    freq = torch.bincount(drawn, minlength=V).double() / num
    assert set(drawn.tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    # 20,000 draws: each frequency within 4 standard deviations of its probability.
    sd = (expected.double() * (1 - expected.double()) / num).sqrt()
    assert torch.all((freq - expected.double()).abs() <= 4 * sd + 1e-9)


def test_the_noise_is_a_function_of_seed_position_and_token() -> None:
    seed, pos = torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3])
    a, b = race_noise(seed, pos, V), race_noise(seed, pos, V)
    assert torch.equal(a, b) and torch.all(a > 0) and torch.isfinite(a).all()
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert a.mean().item() == pytest.approx(1.0, abs=0.15)  # Exp(1) has mean 1
    u = torch.exp(-race_noise(torch.arange(4000), torch.zeros(4000, dtype=torch.int64), 1)).flatten()
    assert abs(u.mean().item() - 0.5) < 0.02 and math.isclose(float((u < 0.25).float().mean()), 0.25, abs_tol=0.02)


def test_the_samplers_static_draw_keeps_greedy_rows_and_reproduces_seeded_ones() -> None:
    g = torch.Generator().manual_seed(2)
    rows = {
        "g": SamplingParams(temperature=0.0, frequency_penalty=0.5),
        "s": SamplingParams(temperature=0.8, seed=11),
        "k": SamplingParams(temperature=1.0, top_k=3, seed=5, min_tokens=2),
        "u": SamplingParams(temperature=1.0),
    }
    samplers = [Sampler(V, torch.device("cpu"), static_draw=flag) for flag in (False, True, True)]
    for sampler in samplers:
        for rid, p in rows.items():
            sampler.add_request(rid, p, [1, 2], (0,))
    for step in range(5):
        logits = torch.randn(len(rows), V, generator=g)
        plain, static, again = ([t.token_id for t in s.sample(logits, list(rows))] for s in samplers)
        assert plain[0] == static[0] == again[0]  # greedy
        assert static[1:3] == again[1:3]  # seeded: a function of (seed, position)
        top3 = logits[2].topk(3).indices.tolist()
        assert static[2] in top3 and (step >= 2 or static[2] != 0)  # top-k; min_tokens masks EOS first


@pytest.mark.parametrize("top_p", [None, [0.5, 1.0, 0.9, 0.99]])
def test_the_partial_selection_for_capped_rows_keeps_what_the_sort_keeps(top_p: list[float] | None) -> None:
    generator = torch.Generator().manual_seed(3)
    # Rounded, so that many logits tie with each row's last kept one.
    logits = (torch.randn(4, 5000, generator=generator) * 4).round() / 4
    top_k = torch.tensor([1, 7, 40, 300])
    probs = None if top_p is None else torch.tensor(top_p)
    sorted_rows = apply_top_k_top_p(logits, top_k, probs)
    selected = apply_top_k_top_p(logits, top_k, probs, max_top_k=300)
    assert torch.equal(selected, sorted_rows)
    kept = (selected > -math.inf).sum(dim=-1)
    assert (kept < 5000).all()  # every row was cut
    if top_p is None:
        assert (kept >= top_k).all()  # and kept its k, with whatever ties the k-th


@pytest.mark.parametrize("flat_row", [False, True], ids=["candidates", "fallback-to-sort"])
def test_top_p_on_cpu_keeps_what_the_sort_keeps(flat_row: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-p without a cap on the rows (top_k 0) looks for the nucleus among the largest logits;
    a row whose nucleus reaches past them (a flat distribution) sends the step to the sort."""
    from engine import device_sampling

    V = 8 * device_sampling.TOP_P_CANDIDATES + 7
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(5, V, generator=generator) * 16).round() / 4  # peaked rows, ties
    if flat_row:
        logits[3] = torch.randn(V, generator=generator) * 0.05
    top_k = torch.tensor([0, 0, 50, 0, 0])
    top_p = torch.tensor([0.9, 0.5, 0.8, 0.95, 1.0])
    real = device_sampling._top_p_from_candidates
    results: list[bool] = []

    def spy(*args: torch.Tensor) -> torch.Tensor | None:
        out = real(*args)
        results.append(out is not None)
        return out

    monkeypatch.setattr(device_sampling, "_top_p_from_candidates", spy)
    got = apply_top_k_top_p(logits, top_k, top_p)
    assert results == [not flat_row]
    monkeypatch.setattr(device_sampling, "TOP_P_CANDIDATES", V)  # the vocabulary is now too small: the sort
    want = apply_top_k_top_p(logits, top_k, top_p)
    assert results == [not flat_row]
    assert torch.equal(got, want)
    kept = (got > -math.inf).sum(dim=-1).tolist()
    assert kept[4] == V and kept[2] >= 1 and all(1 <= n < V for n in kept[:4])
