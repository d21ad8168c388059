"""The input processor is the one place user input is checked against the model: max_tokens
resolved against the context, token ids against one vocabulary size, the grammar; and it fans n
out into samples."""

from __future__ import annotations

import pytest

from engine.errors import CONTEXT_LENGTH_EXCEEDED, ContextLengthError
from engine.front.input_processor import (
    InputProcessor,
    MaxTokens,
    MaxTokensPolicy,
    child_request_id,
    resolve_max_tokens,
)
from scheduler.request import ParamError, SamplingParams
from scheduler.structured_output import StructuredOutput

VOCAB = 24


def processor(max_model_len: int = 32, policy: MaxTokensPolicy = "reject") -> InputProcessor:
    return InputProcessor(VOCAB, max_model_len, eos_token_ids=(2,), max_tokens_policy=policy)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([1, 2], {"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ([1, 2], {"logit_bias": {-1: 1.0}}, "logit_bias"),
        ([1, 2], {"stop_token_ids": (-1,)}, "stop_token_ids"),
        ([1, 2], {"stop_token_ids": (1, VOCAB)}, "stop_token_ids"),
        ([1, VOCAB], {}, "prompt"),
        ([1, -1], {}, "prompt"),
        ([1, 2], {"structured": StructuredOutput.ebnf("root ::= undefined_rule")}, "grammar"),
        ([1, 2], {"structured": StructuredOutput.regex("(unclosed")}, "regex"),
        (list(range(20)) * 2, {}, "prompt"),
        ([1] * 20, {"max_tokens": 13}, "max_tokens"),
        ([], {}, "prompt"),
    ],
)
def test_bad_input_is_a_param_error_naming_the_parameter(
    prompt: list[int], params: dict[str, object], param: str
) -> None:
    with pytest.raises(ParamError) as excinfo:
        processor().process("r", prompt, SamplingParams(**params))  # type: ignore[arg-type]
    assert excinfo.value.param == param


@pytest.mark.parametrize(
    ("num_prompt", "max_len", "cap", "expected"),
    [(10, 100, None, 90), (1, 2, None, 1), (99, 100, None, 1), (10, 100, 30, 30), (80, 100, 30, 20)],
)
def test_absent_max_tokens_means_the_room_left_capped_by_max_output_tokens(
    num_prompt: int,
    max_len: int,
    cap: int | None,
    expected: int,
) -> None:
    assert resolve_max_tokens(None, num_prompt, max_len, cap) == MaxTokens(expected)
    [req] = InputProcessor(VOCAB, max_len, (2,), max_output_tokens=cap).process(
        "r", [1] * num_prompt, SamplingParams(max_tokens=None)
    )
    assert req.params.max_tokens == expected


def test_a_prompt_filling_the_context_is_refused_with_its_numbers() -> None:
    with pytest.raises(ContextLengthError) as excinfo:
        processor(max_model_len=100).process("r", [1] * 100, SamplingParams(max_tokens=None))
    err = excinfo.value
    assert (err.param, err.code) == ("prompt", CONTEXT_LENGTH_EXCEEDED)
    assert (err.num_prompt_tokens, err.max_tokens, err.max_model_len) == (100, None, 100)
    assert "100 tokens" in err.message and "maximum context length is 100" in err.message


def test_max_tokens_beyond_the_context_is_refused_naming_all_three_numbers() -> None:
    with pytest.raises(ContextLengthError) as excinfo:
        resolve_max_tokens(50, 60, 100, cap=None, policy="reject")
    err = excinfo.value
    assert (err.param, err.code) == ("max_tokens", CONTEXT_LENGTH_EXCEEDED)
    assert (err.num_prompt_tokens, err.max_tokens, err.max_model_len) == (60, 50, 100)
    assert all(str(n) in err.message for n in (50, 60, 100))


def test_the_largest_valid_ids_and_a_prompt_that_leaves_one_token_pass() -> None:
    [req] = processor().process("r", [VOCAB - 1] * 31, SamplingParams(max_tokens=1, logit_bias={VOCAB - 1: 5.0}))
    assert req.prompt_token_ids == (VOCAB - 1,) * 31 and req.eos_token_ids == (2,)


def test_n_samples_become_one_engine_request_each_with_seed_plus_index() -> None:
    reqs = processor().process("r", [1, 2, 3], SamplingParams(n=3, seed=10, max_tokens=4), arrival_time=5.0)
    assert [r.request_id for r in reqs] == [child_request_id("r", i) for i in range(3)] == ["r#0", "r#1", "r#2"]
    assert [(r.params.n, r.params.seed) for r in reqs] == [(1, 10), (1, 11), (1, 12)]
    assert {r.arrival_time for r in reqs} == {5.0}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 9.0),
        ("temperature", 2.01),
        ("top_p", 1.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
    ],
)
def test_openai_ranges_are_enforced(field: str, value: float) -> None:
    with pytest.raises(ParamError) as excinfo:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert excinfo.value.param == field


def test_chat_messages_become_ids_through_the_checkpoints_template_and_its_tail_tells_the_think_block() -> None:
    from api.pipeline import prompt_closes_reasoning
    from engine.front.tokenizer import Tokenizer
    from engine.weights.demo_model import ensure_demo_model

    tokenizer = Tokenizer(ensure_demo_model())
    inputs = InputProcessor(151_936, 4096, (), tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    ids = inputs.render_chat(messages, None, True, {"enable_thinking": False})
    assert ids == tokenizer.apply_chat_template(messages, None, True, enable_thinking=False)
    assert prompt_closes_reasoning(inputs.prompt_tail(ids))
    assert not prompt_closes_reasoning(inputs.prompt_tail(inputs.render_chat(messages, None, True, {})))
    with pytest.raises(ParamError) as excinfo:
        inputs.render_chat([], None, True, {})  # the template refuses an empty chat
    assert excinfo.value.param == "messages"


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_top_logprobs_than_the_vocabulary_has_are_refused(field: str) -> None:
    inputs = InputProcessor(10, 32, ())
    with pytest.raises(ParamError) as excinfo:
        inputs.process("r", [1, 2], SamplingParams(**{field: 11}))  # type: ignore[arg-type]
    assert excinfo.value.param == field
    [req] = inputs.process("r", [1, 2], SamplingParams(**{field: 10}))  # type: ignore[arg-type]
    assert getattr(req.params, field) == 10


def test_echo_shows_a_text_prompt_as_sent_and_decodes_one_sent_as_ids() -> None:
    from engine.front.tokenizer import Tokenizer
    from engine.weights.demo_model import ensure_demo_model

    tokenizer = Tokenizer(ensure_demo_model())
    inputs = InputProcessor(151_936, 4096, (), tokenizer)
    ids = inputs.encode("Hello there, world")
    first = tokenizer.token_text(ids[0])[0]
    assert inputs.echo_text(ids, "Hello there, world") == ("Hello there, world", first)
    assert inputs.echo_text(ids, None) == (tokenizer.decode(ids, skip_special_tokens=False), first)
    assert inputs.echo_text(ids, None)[0] == "Hello there, world" and first == "Hello"


@pytest.mark.parametrize(
    ("requested", "cap", "expected"),
    [
        (32000, None, MaxTokens(40, "context")),
        (40, None, MaxTokens(40)),
        (39, None, MaxTokens(39)),
        (30, 8, MaxTokens(8, "cap")),
        (32000, 100, MaxTokens(40, "context")),
        (32000, 40, MaxTokens(40, "context")),
    ],
)
def test_clamp_lowers_max_tokens_to_the_room_left_and_the_cap_caps(
    requested: int, cap: int | None, expected: MaxTokens
) -> None:
    assert resolve_max_tokens(requested, 60, 100, cap, policy="clamp") == expected


def test_reject_refuses_past_the_room_but_the_cap_still_only_caps() -> None:
    assert resolve_max_tokens(30, 60, 100, cap=8, policy="reject") == MaxTokens(8, "cap")
    with pytest.raises(ContextLengthError):
        resolve_max_tokens(41, 60, 100, cap=8, policy="reject")


def test_a_clamped_request_runs_with_the_room_left_and_one_info_line_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="fp4serve.engine"):
        [req] = processor(max_model_len=100, policy="clamp").process(
            "req-7", [1] * 60, SamplingParams(max_tokens=32000)
        )
    assert req.params.max_tokens == 40
    [line] = [r.getMessage() for r in caplog.records if "lowered" in r.getMessage()]
    assert line.startswith("req-7: max_tokens 32000 lowered to 40") and "--max-tokens-policy clamp" in line
    caplog.clear()
    with caplog.at_level("INFO", logger="fp4serve.engine"):
        processor(max_model_len=100, policy="clamp").process("req-8", [1] * 60, SamplingParams(max_tokens=40))
    assert not [r for r in caplog.records if "lowered" in r.getMessage()]


def test_a_prompt_that_fills_the_context_is_refused_under_clamp_too() -> None:
    with pytest.raises(ContextLengthError) as excinfo:
        processor(max_model_len=100, policy="clamp").process("r", [1] * 100, SamplingParams(max_tokens=5))
    assert excinfo.value.max_tokens is None and excinfo.value.param == "prompt"
