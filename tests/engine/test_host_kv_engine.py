"""The host KV tier end to end (engine, float32, tiny random models): agent conversations taking
turns round-robin in a device KV cache that holds about one of them, so every turn's history has been
evicted; greedy output with the tier on equals the tier off and caching off, token for token (dense,
MoE, hybrid, hybrid with MTP); the history comes back from the host (loads counted, cached tokens
reported); no page, slot, checkpoint or host slot leaks after a cancellation mid-step and preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.front.offline import OfflineEngine
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import make_engine
from tests.factories import make_checkpoint, make_hybrid_checkpoint, make_moe_checkpoint
from tests.mtp_factory import add_mtp_tensors

LIN, FULL = "linear_attention", "full_attention"
HYBRID = dict(num_hidden_layers=4, layer_types=[LIN, FULL] * 2, max_position_embeddings=1024)
GREEDY = dict(temperature=0.0, ignore_eos=True)
TIER = 0.01  # GiB: thousands of pages, far more than the conversations need
PAGE_KIB = {"dense": 2, "moe": 3, "hybrid": 2}  # one page of 4 tokens, every attention layer, float32


def kv_pages(kind: str, num_pages: int) -> str:
    return f"{num_pages * PAGE_KIB[kind]}KiB"


def words(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def round_robin(engine: OfflineEngine, num_convs: int = 4, num_turns: int = 3) -> tuple[list[list[int]], list[int]]:
    """Each conversation's turn resends its history plus the answer and a new message; the
    conversations take turns. (outputs, cached tokens) per request, in order."""
    convs = [words(60, c) for c in range(num_convs)]
    outputs, cached = [], []
    for turn in range(num_turns):
        for c in range(num_convs):
            [r] = engine.generate([convs[c]], SamplingParams(max_tokens=5, **GREEDY))
            outputs.append(r.token_ids[0])
            cached.append(r.outputs[0][-1].num_cached_tokens)
            convs[c] = convs[c] + r.token_ids[0] + words(7, 100 + 10 * turn + c)
    return outputs, cached


def assert_no_leaks(engine: OfflineEngine) -> None:
    s = engine.core.scheduler
    assert not s.has_unfinished()
    s.block_manager.check_invariants()
    assert s.block_manager.num_used_blocks == 0, "pages still held"
    if s.slots is not None:
        assert s.slots.num_used_slots == 0, "state slots still held"
    if s.checkpoints is not None:
        s.checkpoints.check_invariants()
    assert s.host is not None
    s.host.check_invariants()
    assert s.host.take_copies().page_loads == (), "loads left for no step"


MODELS: dict[str, Callable[[Path], Path]] = {
    "dense": lambda p: make_checkpoint(p),
    "moe": lambda p: make_moe_checkpoint(p),
    "hybrid": lambda p: make_hybrid_checkpoint(p, **HYBRID),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, MODELS[request.param](tmp_path_factory.mktemp(request.param))


def small(kind: str, **overrides: Any) -> dict[str, Any]:
    """A device cache of 32 pages of 4 tokens: about one conversation's history. Hybrid: few device
    checkpoints, so snapshots spill to the host too."""
    return {
        "block_size": 4,
        "kv_cache_memory": kv_pages(kind, 32),
        "max_num_seqs": 2,
        **(dict(num_state_checkpoints=3) if kind == "hybrid" else {}),
        **overrides,
    }


def test_turns_evicted_from_the_device_come_back_from_the_host_and_equal_tier_off_and_caching_off(
    model: tuple[str, Path],
) -> None:
    kind, path = model
    on = make_engine(path, **small(kind, kv_offloading_size=TIER))
    got, cached = round_robin(on)
    off_out, off_cached = round_robin(make_engine(path, **small(kind)))
    none_out, _ = round_robin(make_engine(path, **small(kind, enable_prefix_caching=False)))
    assert got == off_out == none_out
    host = on.core.scheduler.host
    assert host is not None and host.num_spilled_pages > 0 and host.num_loaded_pages > 0
    # Turns 2 and 3 of every conversation: the device lost their history; the host served most of it.
    later = cached[4:]
    assert sum(off_cached[4:]) == 0 and min(later) >= 56
    if kind == "hybrid":
        assert host.num_spilled_snapshots > 0 and host.num_loaded_snapshots > 0
    assert host.num_hit_tokens == sum(later) - sum(c for c in later if c == 0)
    stats = on.core.scheduler.stats().host
    assert stats is not None and stats.loaded_pages == host.num_loaded_pages and stats.used_bytes > 0
    assert_no_leaks(on)


def test_mtp_speculation_with_host_loaded_turns_equals_tier_off(tmp_path: Path) -> None:
    ckpt = add_mtp_tensors(make_hybrid_checkpoint(tmp_path / "mtp", **HYBRID))
    mtp: dict[str, Any] = dict(speculative_method="mtp", num_speculative_tokens=3, speculative_max_batch=8)
    mtp["kv_cache_memory"] = "96KiB"  # the MTP head is a third attention layer on the pages
    on = make_engine(ckpt, **small("hybrid", kv_offloading_size=TIER, **mtp))
    got, cached = round_robin(on)
    assert got == round_robin(make_engine(ckpt, **small("hybrid", **mtp)))[0]
    assert got == round_robin(make_engine(ckpt, **small("hybrid", enable_prefix_caching=False, **mtp)))[0]
    assert min(cached[4:]) > 0
    assert_no_leaks(on)


def test_a_request_cancelled_while_its_loads_run_leaks_nothing_and_its_pages_serve_the_next(
    model: tuple[str, Path],
) -> None:
    kind, path = model
    engine = make_engine(path, **small(kind, kv_offloading_size=TIER))
    reference = make_engine(path, **small(kind, enable_prefix_caching=False))
    history = [words(60, c) for c in range(3)]
    for prompt in history:  # the first is on the host by the time the others ran
        engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    prompt = history[0] + words(9, 50)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, **GREEDY))
    core = engine.core
    out = core.schedule()
    assert out.host_copies.page_loads, "the history comes from the host"
    engine.abort(rid)  # while the step that loads its pages is under way
    core.update(out, core.execute(out))
    assert_no_leaks(engine)
    [again] = engine.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))
    assert again.outputs[0][-1].num_cached_tokens >= 56
    [want] = reference.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))
    assert again.token_ids == want.token_ids
    assert_no_leaks(engine)


def test_preemption_under_a_tiny_device_cache_leaks_nothing_and_equals_caching_off(model: tuple[str, Path]) -> None:
    kind, path = model
    tight = dict(kv_cache_memory=kv_pages(kind, 16), max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [words(30, c) + words(3 + c, 40 + c) for c in range(4)] * 2
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine = make_engine(path, **small(kind, kv_offloading_size=TIER, **tight))
    got = [r.token_ids for r in engine.generate(prompts, params)]
    want = [
        r.token_ids
        for r in make_engine(path, **small(kind, enable_prefix_caching=False, **tight)).generate(prompts, params)
    ]
    assert got == want
    assert engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(engine)
