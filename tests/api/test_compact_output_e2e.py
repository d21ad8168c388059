"""Forced output on a weak model, end to end (issue 26, defect 10): the random-weight demo model on a
real server, read with the `openai` SDK. A forced tool call and a json_schema reply both finish
well inside 200 tokens, and the reply is compact JSON (json.dumps' separators, no other
whitespace): the grammar leaves a weak model no room to pad its budget with newlines and tabs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.server_utils import RunningServer, running_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "Set the mode, then tell me the level."}]
# Values a random model cannot run on forever (a free string it might never close): enums,
# integers, booleans, as in tests/api/test_tools_e2e.py.
MODE = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["fast", "slow"]},
                "level": {"type": "integer"},
                "force": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            },
            "required": ["mode", "level"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "slow"]},
    },
    "required": ["ok", "level", "mode"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server("--model", DEMO_MODEL_NAME, "--tool-parser", "qwen3", "--max-model-len", "1024") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai(timeout=120)


def create(client: openai.OpenAI, seed: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, **kwargs
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_call_on_the_random_model_finishes_within_200_tokens(client: openai.OpenAI, seed: int) -> None:
    reply = create(client, seed, tools=[MODE], tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "set_mode" and arguments["mode"] in ("fast", "slow")
    assert reply.usage.completion_tokens < MAX_TOKENS


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_json_schema_reply_on_the_random_model_is_compact_and_finishes(client: openai.OpenAI, seed: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "state", "schema": SCHEMA}}
    reply = create(client, seed, response_format=fmt)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    text = choice.message.content
    value = json.loads(text)
    assert text == json.dumps(value)  # no whitespace but the separators' single spaces
    assert set(value) == {"ok", "level", "mode"} and reply.usage.completion_tokens < MAX_TOKENS
