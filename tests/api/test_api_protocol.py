"""Request parsing without a server: OpenAI bodies validated into ChatCompletionRequest /
CompletionRequestModel and their SamplingParams, and the 400s (with the offending `param`) for every
kind of user mistake. Token ids against the model's vocabulary, the context length and max_tokens
are the input processor's (tests/engine/test_input_processor.py)."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import APIError
from api.request.messages import parse_messages
from api.request.models import ChatCompletionRequest, CompletionRequestModel, parse_prompts
from api.request.validation import validate
from scheduler.request import SamplingParams


def parse_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """As the pipeline takes a body: validated, then its sampling parameters (before the template)."""
    chat: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    chat.to_sampling_params()
    return chat


def parse_completion_request(body: dict[str, Any]) -> CompletionRequestModel:
    req: CompletionRequestModel = validate(CompletionRequestModel, body)
    req.to_sampling_params()
    return req


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def rejected(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


def test_chat_sampling_fields_reach_sampling_params() -> None:
    req = parse_chat_request(
        chat_body(
            n=3,
            max_tokens=7,
            min_tokens=2,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias={"5": 10, "3": -100},
            seed=42,
            stop=["a", "bc"],
            stop_token_ids=[7, 8],
            ignore_eos=True,
            skip_special_tokens=False,
            logprobs=True,
            top_logprobs=4,
        ),
    )
    assert req.to_sampling_params() == SamplingParams(
        n=3,
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias=((3, -100.0), (5, 10.0)),
        seed=42,
        stop=("a", "bc"),
        stop_token_ids=(7, 8),
        ignore_eos=True,
        logprobs=4,
        skip_special_tokens=False,
    )
    assert req.max_tokens_requested == 7 and req.num_top_logprobs == 4


def test_defaults_when_fields_are_absent_or_null() -> None:
    req = parse_chat_request(chat_body(temperature=None, stop=None, n=None, stream=None))
    assert req.to_sampling_params() == SamplingParams(max_tokens=None)
    assert req.max_tokens_requested is None and req.num_top_logprobs is None and not req.streaming


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat_request(chat_body(max_tokens=5, max_completion_tokens=9)).max_tokens_requested == 9


def test_logprobs_without_top_logprobs_asks_for_the_sampled_token_only() -> None:
    assert parse_chat_request(chat_body(logprobs=True)).to_sampling_params().logprobs == 0
    assert parse_chat_request(chat_body(logprobs=False)).to_sampling_params().logprobs is None


def test_single_stop_string_and_integral_float_are_accepted() -> None:
    req = parse_chat_request(chat_body(stop="END", max_tokens=12.0))
    assert req.to_sampling_params().stop == ("END",) and req.max_tokens_requested == 12


def test_include_usage_only_counts_when_streaming() -> None:
    assert parse_chat_request(chat_body(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse_chat_request(chat_body(stream_options={"include_usage": True})).include_usage


def test_enable_thinking_joins_chat_template_kwargs_without_overriding_them() -> None:
    req = parse_chat_request(chat_body(enable_thinking=False, chat_template_kwargs={"foo": 1}))
    assert req.template_kwargs == {"enable_thinking": False, "foo": 1}
    req = parse_chat_request(chat_body(enable_thinking=True, chat_template_kwargs={"enable_thinking": False}))
    assert req.template_kwargs == {"enable_thinking": False}


def test_unknown_fields_and_plain_text_format_are_ignored() -> None:
    body = chat_body(user="u1", metadata={"x": 1}, store=False, response_format={"type": "text"})
    assert parse_chat_request(body).to_sampling_params() == SamplingParams(max_tokens=None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 9}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": "10"}, "max_completion_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": "1"}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"enable_thinking": "no"}, "enable_thinking"),
        ({"model": 3}, "model"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_chat_rejects_bad_parameter_naming_it(fields: dict[str, Any], param: str) -> None:
    err = rejected(parse_chat_request, chat_body(**fields))
    assert err.param == param
    assert param.split(".")[0] in err.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0].function.name"),
        ([{"role": "tool", "content": "r", "tool_call_id": 3}], "messages[0].tool_call_id"),
    ],
)
def test_bad_messages_are_rejected_naming_the_message(messages: Any, param: str) -> None:
    err = rejected(parse_chat_request, {"messages": messages})
    assert err.param == param


def test_messages_are_normalised_for_templates() -> None:
    messages = parse_messages(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "thinking",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"truncated'}},
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"},
        ]
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "thinking",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}, "id": "call_1"},
                {"type": "function", "function": {"name": "g", "arguments": '{"truncated'}, "id": "call_2"},
            ],
        },
        {"role": "tool", "content": "42", "name": "f", "tool_call_id": "call_1"},
    ]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tools_and_named_tool_choice_are_kept() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    req = parse_chat_request(chat_body(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False))
    assert req.tools == TOOLS and req.tool_choice == choice and req.calls_in_parallel is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_rejected(fields: dict[str, Any], param: str) -> None:
    assert rejected(parse_chat_request, chat_body(**fields)).param == param


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [4, 5]], ["a", [4, 5]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert parse_prompts(prompt) == expected


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (None, "prompt"),
        ("", "prompt"),
        ([], "prompt"),
        ([[1], []], "prompt[1]"),
        (["a", 3.5], "prompt[1]"),
        ([True, False], "prompt[0]"),
    ],
)
def test_bad_prompts_are_rejected(prompt: Any, param: str) -> None:
    assert rejected(parse_prompts, prompt).param == param


def test_completion_logprobs_is_an_int_in_range() -> None:
    assert parse_completion_request(completion_body(logprobs=3)).to_sampling_params().logprobs == 3
    assert rejected(parse_completion_request, completion_body(logprobs=21)).param == "logprobs"
    assert rejected(parse_completion_request, completion_body(logprobs=True)).param == "logprobs"


def test_suffix_is_refused_not_ignored() -> None:
    assert rejected(parse_completion_request, completion_body(suffix="x")).param == "suffix"


def test_echo_and_prompt_logprobs_ask_the_engine_to_score_the_prompt() -> None:
    plain = parse_completion_request(completion_body(logprobs=2))
    assert plain.to_sampling_params().prompt_logprobs is None and not plain.echo
    echoed = parse_completion_request(completion_body(logprobs=2, echo=True))
    assert echoed.echo and echoed.to_sampling_params().prompt_logprobs == 2
    both = parse_completion_request(completion_body(logprobs=1, echo=True, prompt_logprobs=3))
    params = both.to_sampling_params()
    assert (both.prompt_logprobs, params.prompt_logprobs, params.logprobs) == (3, 3, 1)
    alone = parse_completion_request(completion_body(prompt_logprobs=0))
    assert (alone.prompt_logprobs, alone.to_sampling_params().prompt_logprobs) == (0, 0) and not alone.echo


def test_max_tokens_0_with_echo_runs_one_token_and_shows_the_prompt_alone() -> None:
    req = parse_completion_request(completion_body(max_tokens=0, echo=True))
    assert req.prompt_only and req.to_sampling_params().max_tokens == 1
    err = rejected(parse_completion_request, completion_body(max_tokens=0))
    assert err.param == "max_tokens" and "echo" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": "x"}, "echo"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_echo_and_prompt_logprobs_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    assert rejected(parse_completion_request, completion_body(**fields)).param == param
