"""Data parallel at the engine's front, on a tiny model: two engine cores on threads of the test
process (the same front as the server's, which runs each core in a process of its own:
tests/api/test_data_parallel_server.py), so that a test can look into each core. Greedy outputs equal
one core's and transformers' token for token, with concurrent requests spread over both cores; a
request's n samples share one core; a conversation's later turns land on the core that cached its
prefix; a lost core ends only the requests it held; each core is told the other's fair-share
counts before new requests reach it; the grammar-cache series sum the cores, across a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from api.ops.stats import StatsFeed
from engine.config import EngineConfig
from engine.core_types import EngineCoreOutputs, GrammarCacheStats, Owner
from engine.front.async_engine import AsyncEngine
from engine.front.metrics import EngineMetrics
from engine.front.outputs import RequestOutput
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import hf_greedy
from tests.engine.test_engine_e2e import CFG, alone, collect, prompt_for

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REPLY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def run_two_cores(path: Path, body: Callable[[AsyncEngine], Awaitable[Any]], **cfg: Any) -> Any:
    async def main() -> Any:
        config = EngineConfig(model=str(path), engine_process=False, data_parallel_size=2, **{**CFG, **cfg})
        engine = AsyncEngine.from_config(config)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def finished(engine: AsyncEngine, core: int) -> float:
    """Samples engine core `core` finished, from its vLLM-named series."""
    registry = engine.metrics.registry
    labels = {"model_name": engine.info.model_name, "engine": str(core)}
    return sum(
        registry.get_sample_value("vllm:request_success_total", {**labels, "finished_reason": reason}) or 0.0
        for reason in ("stop", "length", "abort", "error")
    )


def prefix_hits(engine: AsyncEngine, core: int) -> float:
    labels = {"model_name": engine.info.model_name, "engine": str(core)}
    return engine.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", labels) or 0.0


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_greedy_on_two_cores_equals_one_core_and_transformers(qwen3_ckpt: Path) -> None:
    prompts = [prompt_for(i) for i in range(12)]
    expected = [alone(qwen3_ckpt, p, GREEDY) for p in prompts]

    async def body(engine: AsyncEngine) -> list[list[RequestOutput]]:
        results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))
        assert finished(engine, 0) > 0 and finished(engine, 1) > 0, "both cores should have served"
        assert finished(engine, 0) + finished(engine, 1) == len(prompts)
        return results

    results = run_two_cores(qwen3_ckpt, body)
    assert [tokens_of(outs) for outs in results] == expected
    for i in (0, 5):
        assert expected[i] == hf_greedy(qwen3_ckpt, prompts[i], GREEDY.max_tokens)[0]


def test_our_series_sum_the_cores_and_vllms_are_per_core(qwen3_ckpt: Path) -> None:
    systems = [list(range(1, 50)), list(range(200, 249))]  # three full pages each, one per core

    async def body(engine: AsyncEngine) -> tuple[dict[str, Any], dict[str, float]]:
        await asyncio.gather(*(collect(engine, f"r{i}", systems[i % 2] + [100 + i], GREEDY) for i in range(6)))
        while engine.stats().num_running:  # the last reports
            await asyncio.sleep(0.01)
        registry = engine.metrics.registry
        ours = {
            name: registry.get_sample_value(name) or 0.0
            for name in (
                "fp4serve_prefix_cache_queries_total",
                "fp4serve_prefix_cache_hits_total",
                "fp4serve_kv_cache_pages_total",
            )
        }
        return StatsFeed().read([registry]), ours

    stats, ours = run_two_cores(qwen3_ckpt, body)
    engines = stats["engines"]
    assert [e["engine"] for e in engines] == [0, 1] and all(e["prefix_queried_tokens"] > 0 for e in engines)
    assert sum(e["prefix_queried_tokens"] for e in engines) == ours["fp4serve_prefix_cache_queries_total"] == 6 * 50
    assert [e["prefix_hit_tokens"] for e in engines] == [2 * 48, 2 * 48]
    assert ours["fp4serve_prefix_cache_hits_total"] == 4 * 48
    assert stats["prefix_cache"]["queried_tokens"] == 6 * 50
    assert ours["fp4serve_kv_cache_pages_total"] == stats["kv_cache"]["pages_total"] == 2 * 2048  # 16 MiB each


def test_the_samples_of_one_request_share_a_core(qwen3_ckpt: Path) -> None:
    prompt = list(range(1, 42))  # 2 full pages of 16
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=42, ignore_eos=True)

    async def body(engine: AsyncEngine) -> tuple[list[RequestOutput], list[float]]:
        outs = await collect(engine, "r", prompt, params)
        return outs, [finished(engine, 0), finished(engine, 1)]

    outs, per_core = run_two_cores(qwen3_ckpt, body)
    assert sorted(per_core) == [0, 3]
    # Samples 1 and 2 hit the prompt's pages that sample 0 computed: the same core's cache.
    cached = {o.index: o.num_cached_tokens for o in outs if o.finish_reason is not None}
    assert cached == {0: 0, 1: 32, 2: 32}


def test_a_conversations_later_turns_land_where_its_prefix_is_cached(qwen3_ckpt: Path) -> None:
    """Conversations A and C, while long background requests make the loads uneven: each later
    turn goes to its conversation's core although the other core is less (or as) loaded, where a
    placement by load alone would move it."""
    g = torch.Generator().manual_seed(11)
    openings = {name: torch.randint(0, 500, (40,), generator=g).tolist() for name in "AC"}
    background = SamplingParams(max_tokens=450, ignore_eos=True)

    async def body(engine: AsyncEngine) -> tuple[dict[str, list[int]], list[int], list[float]]:
        prompts, cached, cores = dict(openings), {"A": [], "C": []}, []

        async def turn(name: str) -> None:
            outs = await collect(engine, f"{name}{len(cached[name])}", prompts[name], REPLY)
            cached[name].append(outs[-1].num_cached_tokens)
            prompts[name] = prompts[name] + tokens_of(outs) + [7, len(cached[name])]

        async def start_background(request_id: str) -> Any:
            stream = engine.generate(prompt_for(30 + len(cores)), background, request_id)
            await anext(stream)
            cores.append(engine._core_of[request_id][0])
            return stream

        await turn("A")  # alone: core 0
        b0 = await start_background("b0")  # loads 0, 0: core 0
        await turn("C")  # loads 1, 0: core 1
        await turn("A")  # loads 1, 0: A's prefix on core 0 wins
        b1 = await start_background("b1")  # loads 1, 0: core 1
        await turn("C")  # loads 1, 1: C's prefix on core 1 wins over the lower rank
        await turn("A")
        for stream in (b0, b1):
            await stream.aclose()
        return cached, cores, [prefix_hits(engine, 0), prefix_hits(engine, 1)]

    cached, cores, hits = run_two_cores(qwen3_ckpt, body)
    assert cores == [0, 1]
    # Each later turn finds every full page the turn before computed: 40 + 29 tokens (4 pages),
    # then 72 + 29 (6 pages).
    assert cached == {"A": [0, 64, 96], "C": [0, 64]}
    assert hits == [64 + 96, 64]


def test_a_lost_core_ends_only_the_requests_it_held(qwen3_ckpt: Path) -> None:
    long = SamplingParams(max_tokens=60, ignore_eos=True)

    async def body(engine: AsyncEngine) -> tuple[list[list[RequestOutput]], list[int], list[RequestOutput]]:
        streams = [engine.generate(prompt_for(i), long, f"r{i}") for i in range(4)]
        firsts = [await anext(s) for s in streams]
        cores = [engine._core_of[f"r{i}"][0] for i in range(4)]
        assert sorted(cores) == [0, 0, 1, 1]
        engine.metrics.observe_grammar_cache(GrammarCacheStats(700, 1 << 20, 1, 0, 0, 0, 0, 1, 0), engine_index=1)
        # What core 1's supervisor sends when its engine process dies.
        engine._from_core(EngineCoreOutputs(dead="the engine process exited (exit code -9)", restart="crash"), index=1)
        rests = [[first, *[out async for out in s]] for first, s in zip(firsts, streams)]
        assert engine.metrics.registry.get_sample_value("fp4serve_grammar_cache_bytes") == 0  # gone with core 1
        after = await collect(engine, "after", prompt_for(9), GREEDY)
        return rests, cores, after

    rests, cores, after = run_two_cores(qwen3_ckpt, body)
    for outs, core in zip(rests, cores):
        if core == 1:
            assert (
                outs[-1].error is not None and "engine core 1 was lost" in outs[-1].error and "retry" in outs[-1].error
            )
        else:
            assert outs[-1].error is None and outs[-1].finish_reason == "length" and len(tokens_of(outs)) == 60
    assert after[-1].finish_reason == "length" and len(tokens_of(after)) == GREEDY.max_tokens


def test_a_core_is_told_the_other_cores_fair_share_counts_before_new_requests(qwen3_ckpt: Path) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def collect_as(engine: AsyncEngine, request_id: str, prompt: list[int], key: str) -> list[RequestOutput]:
        return [out async for out in engine.generate(prompt, params, request_id, owner=Owner(key=key))]

    async def body(engine: AsyncEngine) -> None:
        await asyncio.gather(
            *(collect_as(engine, f"{key}{i}", prompt_for(i), key) for i in range(4) for key in ("heavy", "light"))
        )
        schedulers = [client.core.scheduler for client in engine.clients]  # type: ignore[attr-defined]
        charged = [dict(s.fair.charged) for s in schedulers]
        assert all(charged), "both cores should have served"
        stream = engine.generate(prompt_for(20), params, "next", owner=Owner(key="light"))
        await anext(stream)  # it is running: its core applied what was sent before it
        core = engine._core_of["next"][0]
        external = dict(schedulers[core].fair.external)
        await stream.aclose()  # type: ignore[attr-defined]
        assert external == charged[1 - core]

    run_two_cores(qwen3_ckpt, body)


def test_the_grammar_cache_series_sum_the_cores_and_survive_a_core_restart() -> None:
    metrics = EngineMetrics("m", num_engines=2)
    budget = 512 << 20

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name) or 0.0

    # num_bytes, budget, entries, held, compiling, queued, hits, misses, evictions (cumulative last three)
    metrics.observe_grammar_cache(GrammarCacheStats(1000, budget, 2, 0, 1, 0, 5, 2, 0), engine_index=0)
    metrics.observe_grammar_cache(GrammarCacheStats(300, budget, 1, 40, 0, 2, 3, 1, 1), engine_index=1)
    metrics.observe_grammar_cache(GrammarCacheStats(1200, budget, 3, 0, 0, 0, 6, 3, 0), engine_index=0)
    assert value("fp4serve_grammar_cache_bytes") == 1500 and value("fp4serve_grammar_cache_entries") == 4
    assert value("fp4serve_grammar_cache_budget_bytes") == 2 * budget
    assert value("fp4serve_grammar_held_bytes") == 40 and value("fp4serve_grammar_compiles_waiting") == 2
    assert value("fp4serve_grammar_cache_hits_total") == 6 + 3 and value("fp4serve_grammar_cache_misses_total") == 4
    # Core 1 was lost (its cache with it) and its successor counts from zero again.
    metrics.on_core_lost(1)
    assert value("fp4serve_grammar_cache_bytes") == 1200 and value("fp4serve_grammar_cache_entries") == 3
    metrics.observe_grammar_cache(GrammarCacheStats(0, budget, 0, 0, 1, 0, 1, 1, 0), engine_index=1)
    assert value("fp4serve_grammar_cache_bytes") == 1200 and value("fp4serve_grammar_held_bytes") == 0
    assert value("fp4serve_grammar_cache_hits_total") == 6 + 3 + 1
    assert value("fp4serve_grammar_cache_misses_total") == 3 + 1 + 1
    assert value("fp4serve_grammar_cache_evictions_total") == 1
