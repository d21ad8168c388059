"""`response_format` (api/grammars/response_format.py): the grammars checked by xgrammar's own matcher
(one JSON object and nothing else; a think block first only when reasoning; string lengths), the
request refusals with their `param`, and end to end on a real server (in this process, under
hypercorn on 127.0.0.1) read with the official `openai` SDK: the unscripted random demo model,
greedy and seeded, writes JSON that parses and fits the schema, and stops with "stop"; the SDK's
`parse()` helper returns the Pydantic object.

NOTE: a random model almost never closes a free JSON string by itself (1 in ~100 tokens can), so
the json_object cases nudge it with `logit_bias` on the closing tokens, as a model that knows
JSON would be; the schema cases bound their strings with maxLength, which the grammar enforces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from api.app import ServerConfig
from api.errors import APIError
from api.grammars.response_format import (
    ResponseFormat,
    parse_response_format,
    response_format_spec,
)
from api.request.models import ChatCompletionRequest, CompletionRequestModel
from api.request.validation import validate
from engine.config import EngineConfig
from engine.grammars import ebnf
from engine.grammars.schema import MAX_STRING_LENGTH_BOUND
from engine.weights.demo_model import DEMO_MODEL_NAME
from scheduler.structured_output import Reasoning
from tests.server_utils import InProcessServer, in_process_server

# generation_config vllm: the sampling these tests' seeds and biases were chosen under, not the demo
# checkpoint's top_k 20 / top_p 0.95.
ENGINE = EngineConfig(kv_cache_memory="32MiB", max_model_len=1024, generation_config="vllm")
VOCAB = 151_669
MESSAGES = [{"role": "user", "content": "Describe a user account as JSON."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Qwen3 token ids of `"`, `"}`, `"]` (+10: inside a string each is about as likely as all the other
# tokens together) and `}`, `]` (+8: below those, so greedy decoding closes a string, not writes
# a brace into it, and above whitespace and commas, so objects end).
CLOSING_BIAS = {"1": 10, "9207": 10, "1341": 10, "92": 8, "60": 8}
THINK_OPEN_ID, THINK_CLOSE_ID = 151_667, 151_668
THINK_BIAS = {str(THINK_OPEN_ID): 10, str(THINK_CLOSE_ID): 11}
SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "seed-1": {"temperature": 1.0, "seed": 1},
    "seed-2": {"temperature": 1.0, "seed": 2},
    "seed-3": {"temperature": 0.8, "top_p": 0.95, "seed": 3},
}

ACCOUNT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "admin", "tags", "colour"],
    "additionalProperties": False,
}
# No free strings: the think block's closing tag cannot turn up inside the JSON.
MODE = {
    "type": "object",
    "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["mode", "level", "ok"],
}


def json_schema(schema: Any, name: str = "account") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def fits(value: Any, schema: dict[str, Any]) -> bool:
    """A validator for the keywords these tests use (type, properties, required,
    additionalProperties, items, maxItems, enum, minLength, maxLength)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and set(schema.get("required", [])) <= set(value)
            and (schema.get("additionalProperties", True) is not False or set(value) <= set(properties))
            and all(fits(v, properties[k]) for k, v in value.items() if k in properties)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(fits(v, schema.get("items", {})) for v in value)
        )
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return isinstance(value, str) and lo <= len(value) and (hi is None or len(value) <= hi)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


# ---- the grammars, by xgrammar's matcher -------------------------------------------------------------------
Accepts = Callable[[str, str], bool]


@pytest.fixture(scope="module")
def accepts() -> Accepts:
    """Whether a grammar matches a whole text, character by character."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)

    def check(grammar: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        return matcher.accept_string(text) and matcher.is_completed()

    return check


def grammar_of(raw: dict[str, Any], reasoning: bool = False, starts_in_reasoning: bool = False) -> str:
    fmt = parse_response_format(raw)
    assert fmt is not None
    mode = Reasoning.OPEN if starts_in_reasoning else Reasoning.OPTIONAL if reasoning else Reasoning.NONE
    return ebnf(response_format_spec(fmt, mode))


OBJECTS = ["{}", '{"a": [1, {"b": null}], "c": "d\\n\\u00e9"}', json.dumps({"x": {"y": [True]}})]


@pytest.mark.parametrize("text", OBJECTS)
def test_json_object_grammar_takes_any_object(accepts: Accepts, text: str) -> None:
    assert accepts(grammar_of({"type": "json_object"}), text)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"x"',
        "1",
        "null",
        " {}",
        "{} ",
        '{"a": 1}{"b": 2}',
        "{'a': 1}",
        '{"a": 1,}',
        json.dumps({"x": {"y": [True]}}, indent=2),
        '{"a":1}',
        '{"a":\n\t1}',
        "{ }",
    ],
)
def test_json_object_grammar_refuses_anything_but_one_object(accepts: Accepts, text: str) -> None:
    assert not accepts(grammar_of({"type": "json_object"}), text)


@pytest.mark.parametrize(
    ("text", "reasoning", "starts_in_reasoning", "accepted"),
    [
        ('<think>\nLet me see.\n</think>\n\n{"a": 1}', True, False, True),
        ('{"a": 1}', True, False, True),  # the think block is optional
        ("<think>\nLet me see.\n</think>\n\n", True, False, False),  # ...the object is not
        ('<think>x</think>{"a": 1}', False, False, False),  # no reasoning: the object alone
        ('Sure! {"a": 1}', True, False, False),
        ('Let me see.\n</think>\n\n{"a": 1}', False, True, True),  # the prompt opened the block
        ('{"a": 1}', False, True, False),  # ...so it must close first
    ],
)
def test_a_think_block_may_come_first_only_with_reasoning(
    accepts: Accepts, text: str, reasoning: bool, starts_in_reasoning: bool, accepted: bool
) -> None:
    assert accepts(grammar_of({"type": "json_object"}, reasoning, starts_in_reasoning), text) is accepted


@pytest.mark.parametrize(
    ("bounds", "lengths_in", "lengths_out"),
    [
        ({"maxLength": 3}, [0, 1, 3], [4, 10]),
        ({"minLength": 2}, [2, 3, 40], [0, 1]),
        ({"minLength": 2, "maxLength": 4}, [2, 3, 4], [1, 5]),
        ({"minLength": 3, "maxLength": 3}, [3], [2, 4]),
        # Above the bound neither side is enforced: the grammar allows more than the schema.
        ({"minLength": MAX_STRING_LENGTH_BOUND + 1, "maxLength": MAX_STRING_LENGTH_BOUND + 2}, [0, 50], []),
    ],
)
def test_string_lengths_are_enforced(
    accepts: Accepts, bounds: dict[str, int], lengths_in: list[int], lengths_out: list[int]
) -> None:
    g = grammar_of(json_schema({"type": "string", **bounds}))
    for n in lengths_in:
        assert accepts(g, json.dumps("x" * n)), n
    for n in lengths_out:
        assert not accepts(g, json.dumps("x" * n)), n


def test_an_escape_counts_as_one_character(accepts: Accepts) -> None:
    g = grammar_of(json_schema({"type": "string", "maxLength": 2}))
    assert accepts(g, r'"\n\""') and accepts(g, r'"\u00e9x"')
    assert not accepts(g, r'"\n\"x"')


VALID_ACCOUNTS = [
    {"name": "ann", "age": 31, "admin": False, "tags": [], "colour": "red"},
    {"name": "b" * 12, "age": -4, "admin": True, "tags": ["a", "c", "a"], "colour": "blue"},
]
INVALID_ACCOUNTS = [
    {"name": "", "age": 31, "admin": False, "tags": [], "colour": "red"},  # minLength
    {"name": "b" * 13, "age": 1, "admin": True, "tags": [], "colour": "red"},  # maxLength
    {"name": "ann", "age": 1.5, "admin": True, "tags": [], "colour": "red"},
    {"name": "ann", "age": 1, "admin": "yes", "tags": [], "colour": "red"},
    {"name": "ann", "age": 1, "admin": True, "tags": ["d"], "colour": "red"},
    {"name": "ann", "age": 1, "admin": True, "tags": ["a", "b", "c", "a"], "colour": "red"},
    {"name": "ann", "age": 1, "admin": True, "tags": [], "colour": "pink"},
    {"name": "ann", "age": 1, "admin": True, "tags": []},  # colour is required
    {"name": "ann", "age": 1, "admin": True, "tags": [], "colour": "red", "extra": 1},
]


def test_the_schema_grammar_takes_exactly_the_documents_that_fit(accepts: Accepts) -> None:
    g = grammar_of(json_schema(ACCOUNT))
    for value in VALID_ACCOUNTS:
        assert fits(value, ACCOUNT) and accepts(g, json.dumps(value)), value
        assert not accepts(g, json.dumps(value, separators=(",", ":"))), value  # only json.dumps' separators
    for value in INVALID_ACCOUNTS:
        assert not fits(value, ACCOUNT) and not accepts(g, json.dumps(value)), value


# ---- refusals ---------------------------------------------------------------------------------------------------
def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": DEMO_MODEL_NAME, "messages": MESSAGES, **fields}


def refused(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        validate(ChatCompletionRequest, body)
    assert caught.value.status == 400
    return caught.value


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
NAMED = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
REFUSALS = {
    "not-an-object": ({"response_format": "json_object"}, "response_format"),
    "unknown-type": ({"response_format": {"type": "yaml"}}, "response_format.type"),
    "no-json-schema": ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    "no-name": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    "no-schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    "strict-not-bool": (
        {"response_format": {**NAMED, "json_schema": {**NAMED["json_schema"], "strict": "yes"}}},
        "response_format.json_schema.strict",
    ),
    "with-tool-choice-required": (
        {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
        "response_format",
    ),
    "with-a-named-function": (
        {
            "response_format": json_schema(MODE),
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "response_format",
    ),
}


@pytest.mark.parametrize(("body", "param"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_malformed_response_format_is_refused_naming_it(body: dict[str, Any], param: str) -> None:
    assert refused(chat_body(**body)).param == param


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BAD_SCHEMAS = {
    "not-an-object": ("object", "a schema must be an object"),
    "false": (False, "allows no value"),
    "unknown-type": ({"type": "strng"}, "#/type: unknown type 'strng'"),
    "empty-type-list": ({"type": []}, "#/type"),
    "properties-not-an-object": ({"type": "object", "properties": ["a"]}, "#/properties"),
    "nested-bad-type": ({"properties": {"a/b": {"type": "int"}}}, "#/properties/a~1b/type"),
    "required-not-declared": (
        {"properties": {"a": {}}, "required": ["a", "b"]},
        "'b' is required but not in properties",
    ),
    "required-not-names": ({"required": "a"}, "#/required"),
    "empty-enum": ({"enum": []}, "#/enum"),
    "bounds-reversed": ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems (3) is more than maxItems (2)"),
    "negative-length": ({"type": "string", "maxLength": -1}, "#/maxLength"),
    "any-of-empty": ({"anyOf": []}, "#/anyOf"),
    "dangling-ref": ({"$ref": "#/$defs/missing", "$defs": {}}, "names no schema"),
    "remote-ref": ({"$ref": "https://example.com/s.json"}, "is not supported"),
    "too-deep": (nested_arrays(200), "nested deeper than 64 levels"),
}


@pytest.mark.parametrize(("schema", "says"), BAD_SCHEMAS.values(), ids=BAD_SCHEMAS.keys())
def test_a_bad_schema_is_refused_naming_response_format_and_the_place(schema: Any, says: str) -> None:
    err = refused(chat_body(response_format=json_schema(schema)))
    assert err.param == "response_format"
    assert err.message.startswith("invalid schema for response_format 'account': at #")
    assert says in err.message


@pytest.mark.parametrize("raw", [None, {"type": "text"}])
def test_text_is_no_format(raw: Any) -> None:
    assert validate(ChatCompletionRequest, chat_body(response_format=raw)).response_format is None


def test_tool_choice_auto_and_a_format_go_together() -> None:
    request = validate(
        ChatCompletionRequest, chat_body(response_format=json_schema(MODE), tools=TOOLS, tool_choice="auto")
    )
    assert request.response_format == ResponseFormat("json_schema", MODE, "account", True)


def test_completions_take_a_response_format_too() -> None:
    request = validate(CompletionRequestModel, {"prompt": "x", "response_format": {"type": "json_object"}})
    assert request.response_format == ResponseFormat("json_object")


# ---- end to end: the random demo model on a real server --------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with in_process_server(ServerConfig(engine=ENGINE, reasoning_parser="qwen3")) as running:
        yield running


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, sampling: dict[str, Any], **kwargs: Any) -> Any:
    """A chat completion with thinking off (the template closes the think block)."""
    request = {"model": DEMO_MODEL_NAME, "messages": MESSAGES, "max_tokens": 300, "extra_body": NO_THINKING}
    return client.chat.completions.create(**{**request, **sampling, **kwargs})


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_json_object_output_is_one_object_and_stops(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    completion = chat(client, sampling, response_format={"type": "json_object"}, logit_bias=CLOSING_BIAS)
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_the_same_nudged_model_without_a_format_writes_no_json(client: openai.OpenAI) -> None:
    # Guards the test above: the bias alone does not make JSON; the grammar does.
    [choice] = chat(client, SAMPLINGS["greedy"], logit_bias=CLOSING_BIAS, max_tokens=40).choices
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_json_schema_outputs_fit_the_schema(client: openai.OpenAI) -> None:
    greedy = chat(client, SAMPLINGS["greedy"], response_format=json_schema(ACCOUNT))
    seeded = chat(client, {"temperature": 1.0, "seed": 5}, response_format=json_schema(ACCOUNT), n=3)
    choices = greedy.choices + seeded.choices
    assert [c.finish_reason for c in choices] == ["stop"] * 4
    documents = [json.loads(c.message.content) for c in choices]
    assert all(fits(d, ACCOUNT) for d in documents), documents
    assert len({json.dumps(d) for d in documents[1:]}) > 1  # the seeded samples differ


def test_a_streamed_json_schema_output_fits_once_joined(client: openai.OpenAI) -> None:
    stream = chat(client, SAMPLINGS["seed-1"], response_format=json_schema(ACCOUNT), stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert fits(json.loads(text), ACCOUNT), text


def test_completions_honour_the_format(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=DEMO_MODEL_NAME,
        prompt="A user account as JSON:",
        max_tokens=300,
        temperature=0.0,
        extra_body={"response_format": json_schema(ACCOUNT)},
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop" and fits(json.loads(choice.text), ACCOUNT), choice.text


class Account(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    age: int
    admin: bool
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    colour: Literal["red", "green", "blue"]


@pytest.mark.parametrize("sampling", [SAMPLINGS["greedy"], SAMPLINGS["seed-2"]], ids=["greedy", "seeded"])
def test_the_sdk_parse_helper_returns_the_pydantic_object(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    completion = client.chat.completions.parse(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        response_format=Account,
        max_tokens=300,
        extra_body=NO_THINKING,
        **sampling,
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Account)
    assert choice.message.parsed == Account.model_validate_json(choice.message.content)


def test_with_reasoning_a_think_block_comes_first_and_the_content_is_the_json(client: openai.OpenAI) -> None:
    # <think> is nudged so that the model opens a block, </think> more so that it closes it soon.
    # NOTE: top_p and top_k off: the demo checkpoint's generation_config.json (Qwen3's top_k 20,
    # top_p 0.95) would otherwise keep only the two nudged tokens, and no block would hold text.
    completion = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=300,
        temperature=1.0,
        top_p=1.0,
        seed=4,
        n=3,
        response_format=json_schema(MODE),
        logit_bias=THINK_BIAS,
        extra_body={"return_token_ids": True, "top_k": -1},
    )
    for choice in completion.choices:
        token_ids = choice.model_extra["token_ids"]
        assert token_ids[0] == THINK_OPEN_ID and THINK_CLOSE_ID in token_ids
        assert choice.finish_reason == "stop"
        assert fits(json.loads(choice.message.content), MODE), choice.message.content
    assert any(getattr(c.message, "reasoning_content", None) for c in completion.choices)


def test_with_thinking_disabled_no_think_block_is_allowed(client: openai.OpenAI) -> None:
    [choice] = chat(
        client,
        SAMPLINGS["seed-1"],
        response_format=json_schema(MODE),
        logit_bias=THINK_BIAS,
        extra_body={**NO_THINKING, "return_token_ids": True},
    ).choices
    assert THINK_OPEN_ID not in choice.model_extra["token_ids"]
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) is None
    assert fits(json.loads(choice.message.content), MODE)


ERRORS = {
    "unknown-type": ({"type": "yaml"}, {}, "response_format.type"),
    "bad-schema": (json_schema({"type": "object", "properties": {"a": {"type": "float"}}}), {}, "response_format"),
    "with-tool-choice-required": (
        {"type": "json_object"},
        {"tools": TOOLS, "tool_choice": "required"},
        "response_format",
    ),
}


@pytest.mark.parametrize(("fmt", "extra", "param"), ERRORS.values(), ids=ERRORS.keys())
def test_the_server_answers_400_naming_the_param(
    client: openai.OpenAI, fmt: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=MESSAGES, max_tokens=5, response_format=fmt, **extra
        )
    assert caught.value.status_code == 400
    assert caught.value.param == param
