"""Grammar-constrained decoding end to end in the engine (the demo Qwen3: random weights, the real
151k-token tokenizer): greedy and seeded sampling produce text that matches each grammar exactly
and stop with "stop" when it is complete; unconstrained requests in the same batch sample the
same tokens as alone; a preempted request resumes inside its grammar; a grammar that does not
compile ends only its own request, with an error. Plus the pieces: the bitmask of a completed grammar, and the
mask applied to logits against a plain-torch reference."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.front.offline import OfflineEngine, OfflineResult
from engine.structured_output.manager import GrammarMask, StructuredOutputs, bitmask_words
from scheduler.request import ParamError, SamplingParams
from scheduler.structured_output import StructuredOutput

# 8 pages of 16 tokens (the demo's float32 KV is 4 KiB a token): small enough to preempt.
ENGINE = EngineConfig(kv_cache_memory="512KiB", block_size=16, dtype="float32")
PROMPTS = ["Hello there, how are you", "Write a number", "Say something", "Once upon a time"]

# (EBNF, an independent regex for the same language)
GRAMMARS = {
    "literal": ('root ::= "Hello, world!"', r"Hello, world!"),
    "digits": ('root ::= "The answer is " [1-9] [0-9]{0,2} "."', r"The answer is [1-9][0-9]{0,2}\."),
    "choice": ('root ::= ( "yes" | "no" | "maybe" ) "\\n"', r"(yes|no|maybe)\n"),
    "json": (
        'root ::= "{\\"n\\": " [0-9]{1,4} ", \\"ok\\": " ( "true" | "false" ) "}"',
        r'\{"n": [0-9]{1,4}, "ok": (true|false)\}',
    ),
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=7),
    "seeded-top-p-k": dict(temperature=0.8, top_p=0.9, top_k=50, seed=11),
}


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    return OfflineEngine.from_config(ENGINE)


def encode(engine: OfflineEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(engine: OfflineEngine, requests: list[tuple[str, SamplingParams]]) -> list[OfflineResult]:
    return engine.generate([encode(engine, p) for p, _ in requests], [params for _, params in requests])


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
@pytest.mark.parametrize(("grammar", "pattern"), GRAMMARS.values(), ids=GRAMMARS.keys())
def test_output_matches_the_grammar_and_stops_when_it_is_complete(
    engine: OfflineEngine, grammar: str, pattern: str, sampling: dict[str, Any]
) -> None:
    [result] = run(
        engine, [(PROMPTS[0], SamplingParams(max_tokens=40, structured=StructuredOutput.ebnf(grammar), **sampling))]
    )
    assert re.fullmatch(pattern, result.texts[0]), result.texts[0]
    assert result.finish_reasons == ["stop"]
    *body, last = result.token_ids[0]
    assert last in engine.tokenizer.eos_token_ids
    assert not set(body) & set(engine.tokenizer.eos_token_ids)


def test_the_same_request_unconstrained_does_not_match(engine: OfflineEngine) -> None:
    # Guards the test above: the random model left alone writes none of these languages.
    [result] = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))])
    assert not any(re.fullmatch(pattern, result.texts[0]) for _, pattern in GRAMMARS.values())


def test_unconstrained_requests_in_the_batch_sample_what_they_sample_alone(engine: OfflineEngine) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    constrained = SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutput.ebnf(GRAMMARS["json"][0]))
    alone = [
        run(engine, [(PROMPTS[1], greedy)])[0],
        run(engine, [(PROMPTS[2], seeded)])[0],
        run(engine, [(PROMPTS[3], constrained)])[0],
    ]
    together = run(engine, [(PROMPTS[3], constrained), (PROMPTS[1], greedy), (PROMPTS[2], seeded)])
    assert together[1].token_ids == alone[0].token_ids
    assert together[2].token_ids == alone[1].token_ids
    assert together[0].token_ids == alone[2].token_ids


def test_max_tokens_cuts_a_grammar_short_with_length(engine: OfflineEngine) -> None:
    [result] = run(
        engine,
        [
            (
                PROMPTS[0],
                SamplingParams(max_tokens=2, temperature=0.0, structured=StructuredOutput.ebnf(GRAMMARS["literal"][0])),
            )
        ],
    )
    assert result.finish_reasons == ["length"]
    assert len(result.token_ids[0]) == 2
    assert "Hello, world!".startswith(result.texts[0]) and result.texts[0] != "Hello, world!"


def test_min_tokens_past_the_grammars_end_is_filled_with_stop_tokens(engine: OfflineEngine) -> None:
    params = SamplingParams(
        max_tokens=20, min_tokens=8, temperature=1.0, seed=5, structured=StructuredOutput.ebnf('root ::= "Hi"')
    )
    [result] = run(engine, [(PROMPTS[0], params)])
    ids, stops = result.token_ids[0], set(engine.tokenizer.eos_token_ids)
    first_stop = next(i for i, t in enumerate(ids) if t in stops)
    assert result.texts == ["Hi"] and result.finish_reasons == ["stop"]
    assert len(ids) == 8 and engine.tokenizer.decode(ids[:first_stop]) == "Hi"
    assert set(ids[first_stop:]) <= stops


def test_a_preempted_request_resumes_inside_its_grammar(engine: OfflineEngine) -> None:
    grammar = 'root ::= "n=" [0-9]{40}'
    params = SamplingParams(max_tokens=50, temperature=0.0, structured=StructuredOutput.ebnf(grammar))
    prompts = PROMPTS[:3]
    alone = [run(engine, [(p, params)])[0].token_ids for p in prompts]
    before = engine.core.scheduler.stats().num_preemptions
    together = run(engine, [(p, params) for p in prompts])  # 3 x 3 pages > the 8 of the KV cache
    assert engine.core.scheduler.stats().num_preemptions > before
    assert [r.token_ids for r in together] == alone
    assert all(re.fullmatch(r"n=[0-9]{40}", r.texts[0]) and r.finish_reasons == ["stop"] for r in together)


def test_an_invalid_grammar_is_refused_before_it_is_queued(engine: OfflineEngine) -> None:
    broken = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput.ebnf("root ::= undefined_rule"))
    with pytest.raises(ParamError) as e:
        engine.add_request(PROMPTS[0], broken)
    assert e.value.param == "grammar"
    assert not engine.has_unfinished()


def test_a_grammar_that_does_not_compile_ends_only_its_own_request(
    engine: OfflineEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net behind validation: a grammar that fails inside the engine harms no one else,
    and its own request ends with an error (never as an empty "stop", which reads as the model's
    choice), counted by reason."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    alone = run(engine, [(PROMPTS[1], greedy)])[0]
    monkeypatch.setattr(StructuredOutputs, "check", staticmethod(lambda grammar: None))
    broken = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput.ebnf("root ::= undefined_rule"))
    together = run(engine, [(PROMPTS[0], broken), (PROMPTS[1], greedy)])
    [last] = [out for out in together[0].outputs[0] if out.finish_reason is not None]
    assert together[0].texts == [""] and last.error is not None and "grammar could not be made (compile)" in last.error
    assert together[1].token_ids == alone.token_ids
    assert dict(engine.core.structured.stats().failures)["compile"] >= 1
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("grammar", "valid"),
    [('root ::= "a" [0-9]*', True), ("root ::= undefined_rule", False), ('root ::= "unclosed', False)],
)
def test_check_refuses_invalid_grammars_with_a_param_error(grammar: str, valid: bool) -> None:
    if valid:
        StructuredOutputs.check(StructuredOutput.ebnf(grammar))
        return
    with pytest.raises(ParamError) as e:
        StructuredOutputs.check(StructuredOutput.ebnf(grammar))
    assert e.value.param == "grammar" and e.value.message.startswith("invalid grammar")


@pytest.mark.parametrize("sampling", [SAMPLING["greedy"], SAMPLING["seeded"]], ids=["greedy", "seeded"])
def test_a_regex_spec_is_compiled_by_xgrammar_and_binds_the_output(
    engine: OfflineEngine, sampling: dict[str, Any]
) -> None:
    pattern = r"(yes|no), [1-9][0-9]{0,2}!"
    [result] = run(
        engine, [(PROMPTS[0], SamplingParams(max_tokens=20, structured=StructuredOutput.regex(pattern), **sampling))]
    )
    assert re.fullmatch(pattern, result.texts[0]) and result.finish_reasons == ["stop"], result.texts[0]


def test_an_invalid_regex_is_refused_with_a_param_error() -> None:
    with pytest.raises(ParamError) as e:
        StructuredOutputs.check(StructuredOutput.regex("(unclosed"))
    assert e.value.param == "regex" and e.value.message.startswith("invalid regex")


def test_equal_specs_share_one_compile_and_different_ones_do_not(engine: OfflineEngine) -> None:
    """The cache keys on the spec: a schema sent again (a new dict, the same JSON) is a hit."""
    structured = StructuredOutputs(engine.tokenizer.hf, engine.core.model_config.vocab_size)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    first = structured.prepare(StructuredOutput.json_schema(schema), "a", "r1")
    again = structured.prepare(StructuredOutput.json_schema(json.loads(json.dumps(schema))), "b", "r2")
    optional = {"type": "object", "properties": {"n": {"type": "integer"}}}
    other = structured.prepare(StructuredOutput.json_schema(optional), "a", "r3")
    assert again is first and other is not first
    stats = structured.stats()
    assert stats is not None and (stats.hits, stats.misses) == (1, 2)
    for request_id in ("r1", "r2", "r3"):
        structured.remove_request(request_id)


# ---- the pieces ---------------------------------------------------------------------------------------------
def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def test_a_completed_grammar_allows_only_the_stop_tokens_then_terminates(engine: OfflineEngine) -> None:
    vocab_size = engine.core.model_config.vocab_size
    structured = StructuredOutputs(engine.tokenizer.hf, vocab_size)
    stops = (151645, 151643)
    structured.add_request("r", StructuredOutput.ebnf('root ::= "Hi there"'), stops)
    cpu = torch.device("cpu")
    for token_id in encode(engine, "Hi there"):
        mask = structured.mask(["free", "r"], cpu)
        assert mask is not None and mask.rows == (1,)
        assert token_id in allowed_ids(mask.bitmask[0], vocab_size)
        assert not allowed_ids(mask.bitmask[0], vocab_size) & set(stops)
        structured.accept(["free", "r"], [0, token_id])
    mask = structured.mask(["r"], cpu)
    assert mask is not None and allowed_ids(mask.bitmask[0], vocab_size) == set(stops)
    assert not structured.is_terminated("r")
    structured.accept(["r"], [stops[0]])
    assert structured.is_terminated("r")
    mask = structured.mask(["r"], cpu)  # terminated (min_tokens not reached): stop tokens still
    assert mask is not None and allowed_ids(mask.bitmask[0], vocab_size) == set(stops)
    structured.remove_request("r")
    assert structured.mask(["r"], cpu) is None


@pytest.mark.parametrize(("num_rows", "rows"), [(1, (0,)), (4, (1, 3)), (5, (0, 1, 2, 3, 4))])
def test_the_grammar_mask_sets_forbidden_tokens_to_minus_inf_on_its_rows_only(
    num_rows: int, rows: tuple[int, ...]
) -> None:
    vocab_size = 1000  # not a multiple of 32: the last word is partly padding
    g = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab_size, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (len(rows), bitmask_words(vocab_size)), generator=g, dtype=torch.int64)
    bitmask = words.to(torch.int32)
    original = logits.clone()
    masked = GrammarMask(rows, bitmask, vocab_size).apply(logits)
    expected = original.clone()
    for k, row in enumerate(rows):
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[list(allowed_ids(bitmask[k], vocab_size))] = True
        expected[row] = original[row].masked_fill(~allowed, float("-inf"))
    assert torch.equal(masked, expected)
    assert torch.equal(logits, original)  # the input is not written


def test_a_grammar_still_compiling_never_stalls_other_requests(
    engine: OfflineEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constrained request waits outside the batch; everyone else keeps decoding."""
    import threading
    import time

    release = threading.Event()
    structured = engine.core.structured
    original = structured._compile_now

    def slow_compile(grammar: str) -> Any:
        release.wait(timeout=30)
        return original(grammar)

    monkeypatch.setattr(structured, "_compile_now", slow_compile)
    slow = engine.add_request(
        engine.tokenizer.encode(PROMPTS[0]),
        SamplingParams(max_tokens=4, temperature=0.0, structured=StructuredOutput.ebnf('root ::= "ok" [0-9]')),
    )
    other = engine.add_request(engine.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=4, temperature=0.0))
    finished: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finish_reason is not None:
                finished[out.request_id] = time.monotonic()
        if other in finished:
            release.set()
    assert other in finished and slow in finished
    assert finished[other] < finished[slow]
