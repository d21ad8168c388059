"""vLLM's structured-output request fields through the official `openai` SDK's `extra_body`,
against a real server (hypercorn on 127.0.0.1, in this process) on the demo's random-weight Qwen3:
`structured_outputs` {choice, regex, json, grammar, json_object} and the older guided_choice,
guided_regex, guided_json and guided_grammar, on /v1/chat/completions and /v1/completions, and
vLLM's errors (several kinds at once, none, a bad regex or grammar, with response_format);
structural_tag is tests/api/test_vllm_structural_tag.py's. The random model left alone writes free text,
so each output that matches is
the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from api.app import ServerConfig
from engine.core import EngineCore
from engine.front.async_engine import AsyncEngine
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.api.test_tools_e2e import ENGINE
from tests.server_utils import InProcessServer, in_process_server

MESSAGES = [{"role": "user", "content": "Pick one."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    core = EngineCore(ENGINE)
    with in_process_server(ServerConfig(engine=ENGINE), loader=lambda _: AsyncEngine(core)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, fields: dict[str, Any], max_tokens: int = 60) -> Any:
    [choice] = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=3,
        extra_body={**NO_THINKING, **fields},
    ).choices
    return choice


def complete(client: openai.OpenAI, fields: dict[str, Any], max_tokens: int = 60) -> Any:
    [choice] = client.completions.create(
        model=DEMO_MODEL_NAME, prompt="The answer:", max_tokens=max_tokens, temperature=1.0, seed=3, extra_body=fields
    ).choices
    return choice


def test_free_text_is_none_of_these(client: openai.OpenAI) -> None:
    # The contrast: without a field the random model's text matches no choice.
    assert chat(client, {}, max_tokens=12).message.content not in ("alpha", "beta")


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"choice": ["alpha", "beta gamma", 'q"uote']}},
        {"guided_choice": ["alpha", "beta gamma", 'q"uote']},
    ],
    ids=["structured", "guided"],
)
def test_choice_answers_one_of_the_choices(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    choice = chat(client, fields)
    assert choice.message.content in ("alpha", "beta gamma", 'q"uote') and choice.finish_reason == "stop"
    assert complete(client, fields).text in ("alpha", "beta gamma", 'q"uote')


@pytest.mark.parametrize(
    "fields",
    [{"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"guided_regex": "[0-9]{3}-[a-z]{2}"}],
    ids=["structured", "guided"],
)
def test_regex_output_matches_the_pattern(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", chat(client, fields).message.content)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", complete(client, fields).text)


@pytest.mark.parametrize(
    "fields",
    [{"structured_outputs": {"json": SCHEMA}}, {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}],
    ids=["structured", "guided", "as-text"],
)
def test_json_output_fits_the_schema(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    for text in (chat(client, fields, 80).message.content, complete(client, fields, 80).text):
        value = json.loads(text)
        assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}},
        {"guided_grammar": 'root ::= ("yes" | "no") "!"'},
    ],
    ids=["structured", "guided"],
)
def test_grammar_output_is_in_its_language(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    assert chat(client, fields).message.content in ("yes!", "no!")
    assert complete(client, fields).text in ("yes!", "no!")


def test_json_object_is_one_object(client: openai.OpenAI) -> None:
    choice = chat(client, {"structured_outputs": {"json_object": True}}, 80)
    # The random model may fill a key until max_tokens; an object it is either way.
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "only use one kind of structured outputs constraint"),
        ({"structured_outputs": {}}, "must use one kind of structured outputs constraint"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "only use one kind"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "cannot be combined"),
        ({"guided_choice": []}, "non-empty list of strings"),
        ({"guided_json": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"guided_regex": "(unclosed"}, "invalid regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "invalid grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_vllm_errors_are_400s(client: openai.OpenAI, fields: dict[str, Any], words: str) -> None:
    for call in (chat, complete):
        with pytest.raises(openai.BadRequestError) as e:
            call(client, fields)
        assert words in str(e.value.message)


RANGED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "day": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "month": {"type": "integer", "minimum": 1, "maximum": 12},
        "root": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    },
    "required": ["code", "day", "id", "month", "root"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": RANGED},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "ranged", "schema": RANGED}}},
    ],
    ids=["guided", "response_format"],
)
def test_pattern_format_and_ranges_are_enforced(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    # xgrammar's converter for these keywords, still compact and with bounded numbers.
    for seed in (3, 4):
        [choice] = client.chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body={**NO_THINKING, **fields},
        ).choices
        text = choice.message.content
        value = json.loads(text)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", value["code"]) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["day"])
        assert re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", value["id"])
        assert 1 <= value["month"] <= 12 and 0 < value["root"] <= 1
        assert text == json.dumps(value, ensure_ascii=False)  # compact: ", " and ": " only
