"""The compiled-grammar cache (engine/structured_output/grammar_cache.py, issue 32): bounded by xgrammar's own size of
each compiled grammar, least recently used out, with the bytes it reports never above the budget
and grammars evicted while requests hold them counted apart until they let go;
compiles on a small pool where each key compiles one grammar at a time and keys take turns, so a
small schema from one key is ready while another key's huge one still compiles; and a compile that
nobody waits for any more never runs. Checked on xgrammar directly, through the structured-output
manager, and through the engine with its metrics."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from prometheus_client import generate_latest

from engine.config import EngineConfig
from engine.core_types import Owner
from engine.front.offline import OfflineEngine
from engine.structured_output.grammar_cache import GrammarCache
from engine.structured_output.manager import StructuredOutputs
from scheduler.request import SamplingParams
from scheduler.structured_output import StructuredOutput
from tests.server_utils import metric

WAIT_S = 120  # a bound on a wait that should end at once, not a timing assertion


def literal(text: str) -> StructuredOutput:
    """A grammar for exactly `text` (equal texts: equal specs, one cache entry)."""
    return StructuredOutput.ebnf(f'root ::= "{text}"')


def enum_grammar(salt: str, n: int = 2000) -> StructuredOutput:
    """A JSON string out of `n` values (as a response_format enum becomes)."""
    return StructuredOutput.json_schema({"type": "string", "enum": [f"{salt}-value-{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    return OfflineEngine.from_config(EngineConfig(kv_cache_memory="512KiB", block_size=16, dtype="float32"))


@pytest.fixture(scope="module")
def compile_fn(engine: OfflineEngine) -> Callable[[StructuredOutput], Any]:
    """xgrammar's compiler for the demo's 151k-token vocabulary."""
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size)
    return structured._compile_now


@pytest.fixture(scope="module")
def one_size(compile_fn: Callable[[StructuredOutput], Any]) -> int:
    return compile_fn(enum_grammar("probe")).memory_size_bytes


def test_kept_bytes_stay_within_the_budget_and_the_oldest_grammars_leave(
    compile_fn: Callable[[StructuredOutput], Any], one_size: int
) -> None:
    budget = int(2.5 * one_size)
    cache = GrammarCache(compile_fn, budget_bytes=budget)
    compiled = {}
    for i in range(6):
        grammar = enum_grammar(f"g{i}")
        compiled[grammar] = cache.get(grammar, "alice").result(timeout=WAIT_S)
        stats = cache.stats()
        assert stats.num_bytes <= budget
    stats = cache.stats()
    assert stats.num_entries == 2 and stats.evictions == 4 and stats.misses == 6
    newest = list(compiled)[-2:]
    assert stats.num_bytes == sum(compiled[g].memory_size_bytes for g in newest)
    # The two newest are kept (a hit returns the very object); the oldest compiles again.
    assert cache.get(newest[-1], "bob").result(timeout=WAIT_S) is compiled[newest[-1]]
    assert cache.get(list(compiled)[0], "bob").result(timeout=WAIT_S) is not compiled[list(compiled)[0]]
    assert cache.stats().hits == 1 and cache.stats().misses == 7


def test_a_grammar_larger_than_the_budget_is_served_but_not_kept(
    compile_fn: Callable[[StructuredOutput], Any], one_size: int
) -> None:
    cache = GrammarCache(compile_fn, budget_bytes=one_size // 2)
    grammar = enum_grammar("huge")
    assert cache.get(grammar, "alice").result(timeout=WAIT_S).memory_size_bytes > one_size // 2
    stats = cache.stats()
    assert (stats.num_bytes, stats.num_entries, stats.evictions) == (0, 0, 1)


def test_a_grammar_evicted_while_a_request_holds_it_counts_as_held_until_released(
    compile_fn: Callable[[StructuredOutput], Any], one_size: int
) -> None:
    cache = GrammarCache(compile_fn, budget_bytes=int(1.5 * one_size))
    first = cache.get(enum_grammar("held-1"), "alice")
    size = first.result(timeout=WAIT_S).memory_size_bytes
    unheld = cache.get(enum_grammar("held-2"), "alice", hold=False)
    unheld.result(timeout=WAIT_S)
    stats = cache.stats()
    assert (stats.num_entries, stats.held_bytes, stats.evictions) == (1, size, 1)  # the first left, still held
    cache.release(first)
    stats = cache.stats()
    assert (stats.held_bytes, stats.num_bytes) == (0, unheld.result().memory_size_bytes)
    cache.release(first)  # a second release of the same hold changes nothing
    assert cache.stats().held_bytes == 0


class GatedCompiles:
    """A compile function whose calls are recorded and, for gated grammars, held until released."""

    def __init__(self, compile_fn: Callable[[StructuredOutput], Any]) -> None:
        self.compile_fn = compile_fn
        self.started: list[StructuredOutput] = []
        self.gates: dict[StructuredOutput, threading.Event] = {}
        self.running: dict[StructuredOutput, threading.Event] = {}

    def gate(self, grammar: StructuredOutput) -> StructuredOutput:
        self.gates[grammar], self.running[grammar] = threading.Event(), threading.Event()
        return grammar

    def __call__(self, grammar: StructuredOutput) -> Any:
        self.started.append(grammar)
        if grammar in self.gates:
            self.running[grammar].set()
            assert self.gates[grammar].wait(WAIT_S), "the test never released this compile"
        return self.compile_fn(grammar)


def test_a_small_schema_of_another_key_is_ready_while_a_huge_one_compiles(
    compile_fn: Callable[[StructuredOutput], Any],
) -> None:
    gated = GatedCompiles(compile_fn)
    cache = GrammarCache(gated, budget_bytes=64 << 20)
    huge = cache.get(gated.gate(enum_grammar("huge-1")), "mallory")
    more = [cache.get(enum_grammar(f"huge-{i}"), "mallory") for i in (2, 3)]  # mallory's own wait behind it
    assert gated.running[enum_grammar("huge-1")].wait(WAIT_S)
    small = cache.get(literal("ok"), "alice")
    assert small.result(timeout=WAIT_S).memory_size_bytes > 0
    assert not huge.done() and not any(f.done() for f in more)
    assert cache.stats().num_queued == 2  # mallory compiles one grammar at a time
    gated.gates[enum_grammar("huge-1")].set()
    for future in (huge, *more):
        future.result(timeout=WAIT_S)


def test_keys_take_turns_on_a_busy_pool(compile_fn: Callable[[StructuredOutput], Any]) -> None:
    gated = GatedCompiles(compile_fn)
    cache = GrammarCache(gated, budget_bytes=64 << 20, num_workers=1)
    first = gated.gate(literal("a1"))
    futures = [cache.get(first, "a")]
    assert gated.running[first].wait(WAIT_S)
    futures += [cache.get(literal(name), name[0]) for name in ("a2", "a3", "b1", "c1", "b2")]
    gated.gates[first].set()
    for future in futures:
        future.result(timeout=WAIT_S)
    names = [re.search(r'"(\w+)"', g.text).group(1) for g in gated.started]
    assert names == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_a_compile_nobody_waits_for_never_runs(
    engine: OfflineEngine, compile_fn: Callable[[StructuredOutput], Any]
) -> None:
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size, compile_workers=1)
    gated = GatedCompiles(compile_fn)
    structured._compile_now = gated  # type: ignore[method-assign]
    busy = gated.gate(literal("busy"))
    structured.prepare(busy, "a", "r1")
    assert gated.running[busy].wait(WAIT_S)
    shared = structured.prepare(literal("shared"), "b", "r2")
    assert structured.prepare(literal("shared"), "c", "r3") is shared  # one compile, two waiters
    abandoned = structured.prepare(literal("abandoned"), "b", "r4")
    structured.remove_request("r2")  # r3 still waits for "shared"
    structured.remove_request("r4")  # nobody waits for "abandoned" any more
    assert abandoned.cancelled() and not shared.cancelled()
    gated.gates[busy].set()
    shared.result(timeout=WAIT_S)
    structured.add_request("r3", literal("shared"), [0])
    assert literal("abandoned") not in gated.started
    assert structured.stats().num_queued == 0


def add_for_key(engine: OfflineEngine, key: str, prompt: list[int], params: SamplingParams) -> str:
    """OfflineEngine.add_request, with the request's owner key (the server binds it per request)."""
    request_id = f"{key}-{len(engine.output_processor._children)}"
    children = engine.input_processor.process(request_id, prompt, params, owner=Owner(key=key))
    engine.output_processor.add_request(request_id, children)
    for child in children:
        engine.core.add_request(child)
    return request_id


def test_in_the_engine_one_keys_huge_grammar_holds_up_only_its_own_requests(
    engine: OfflineEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size)
    monkeypatch.setattr(engine.core, "structured", structured)
    monkeypatch.setattr(engine.core.runner, "structured", structured)
    gated = GatedCompiles(structured._compile_now)
    monkeypatch.setattr(structured, "_compile_now", gated)
    huge = gated.gate(enum_grammar("mallory"))
    prompt = engine.tokenizer.encode("Pick one", add_special_tokens=False)
    mallory = add_for_key(engine, "mallory", prompt, SamplingParams(max_tokens=16, temperature=0.0, structured=huge))
    assert gated.running[huge].wait(WAIT_S)
    alice = add_for_key(
        engine, "alice", prompt, SamplingParams(max_tokens=8, temperature=0.0, structured=literal("ok"))
    )
    finished: set[str] = set()
    deadline = time.monotonic() + WAIT_S
    while alice not in finished:
        assert time.monotonic() < deadline, "alice's small grammar waited behind mallory's huge one"
        finished |= {out.request_id for out in engine.step() if out.finish_reason is not None}
    assert mallory not in finished and gated.started == [huge, literal("ok")]
    gated.gates[huge].set()
    while engine.has_unfinished():
        engine.step()


def test_the_engine_keeps_its_grammars_within_the_budget_and_reports_it(
    engine: OfflineEngine, one_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: constrained requests with large enums, a budget of two of them; every
    output still matches its grammar, and the metrics carry the cache's bytes."""
    budget = int(2.5 * one_size)
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size, cache_bytes=budget)
    monkeypatch.setattr(engine.core, "structured", structured)
    monkeypatch.setattr(engine.core.runner, "structured", structured)
    prompt = engine.tokenizer.encode("Pick one", add_special_tokens=False)
    grammars = [enum_grammar(f"e{i}") for i in range(5)]
    results = engine.generate(
        [prompt] * 5, [SamplingParams(max_tokens=16, temperature=0.0, structured=g) for g in grammars]
    )
    for i, result in enumerate(results):
        assert re.fullmatch(rf'"e{i}-value-\d+"', result.texts[0]), result.texts[0]
    stats = structured.stats()
    assert stats is not None and stats.num_bytes <= budget and stats.evictions >= 3
    assert stats.held_bytes == 0  # every request ended and let go of its grammar
    text = generate_latest(engine.metrics.registry).decode()
    assert metric(text, "fp4serve_grammar_cache_bytes") == stats.num_bytes
    assert metric(text, "fp4serve_grammar_cache_budget_bytes") == budget
    assert metric(text, "fp4serve_grammar_cache_misses_total") == 5
    assert metric(text, "fp4serve_grammar_cache_evictions_total") == stats.evictions


def test_stats_are_none_until_a_grammar_is_asked_for(engine: OfflineEngine) -> None:
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size)
    assert structured.stats() is None
    future: Future[Any] = structured.prepare(literal("x"))
    future.result(timeout=WAIT_S)
    assert structured.stats() is not None and structured.stats().misses == 1
