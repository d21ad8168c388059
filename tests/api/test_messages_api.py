"""/v1/messages and /v1/messages/count_tokens through a real server (hypercorn on 127.0.0.1, in
this process) with the official `anthropic` SDK: `messages.create`, `messages.stream`,
`count_tokens`, tool_use with tool_choice {"type": "any"}, auth by x-api-key, and errors in
Anthropic's shape (every kind of error: tests/api/test_messages_errors.py). Scripted answers come
from tests/api/test_tools_e2e.py's ScriptedCore."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from api.app import ServerConfig
from engine.core import EngineCore
from engine.front.async_engine import AsyncEngine
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.api.test_tools_e2e import ARGUMENTS, ENGINE, THINK, ScriptedCore, call_text
from tests.server_utils import HTTP, InProcessServer, in_process_server

KEY = "sk-messages-test"
WEATHER = {
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "hours": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["city", "days"],
    },
}
MODE = {
    "name": "set_mode",
    "input_schema": {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
        "required": ["mode", "level"],
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def scripted() -> ScriptedCore:
    return ScriptedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module")
def server(scripted: ScriptedCore) -> Iterator[InProcessServer]:
    config = ServerConfig(engine=ENGINE, tool_parser="qwen3", reasoning_parser="qwen3", api_key=KEY)
    with in_process_server(config, loader=lambda _: AsyncEngine(scripted)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def client(server: InProcessServer, scripted: ScriptedCore) -> Iterator[anthropic.Anthropic]:
    scripted.clear()
    # The SDK sends x-api-key, anthropic-version (and anthropic-beta when asked).
    yield anthropic.Anthropic(
        base_url=server.url(""),
        api_key=KEY,
        max_retries=0,
        timeout=60,
        default_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    scripted.clear()


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    return client.messages.create(**{"model": DEMO_MODEL_NAME, "max_tokens": 300, "messages": MESSAGES, **kwargs})


def test_create_gives_text_end_turn_and_usage_equal_to_count_tokens(
    scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    num_tokens = scripted.expect("It will be sunny in Paris.")
    request = {
        "messages": MESSAGES,
        "system": [{"type": "text", "text": "Be brief."}],
        "thinking": {"type": "disabled"},
    }
    message = create(client, **request)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == "It will be sunny in Paris."
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == num_tokens
    counted = client.messages.count_tokens(model=DEMO_MODEL_NAME, **request)
    assert counted.input_tokens == message.usage.input_tokens > 5


def test_stream_sends_thinking_then_text_and_the_sdk_assembles_them(
    scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    scripted.expect(THINK + "Sunny.")
    with client.messages.stream(model=DEMO_MODEL_NAME, max_tokens=300, messages=MESSAGES) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "I should call it." and final.content[1].text == "Sunny."
    assert final.stop_reason == "end_turn"


def test_a_scripted_call_streams_input_json_and_stops_with_tool_use(
    scripted: ScriptedCore, client: anthropic.Anthropic
) -> None:
    scripted.expect(call_text("qwen3", "get_weather", ARGUMENTS))
    with client.messages.stream(
        model=DEMO_MODEL_NAME, max_tokens=300, messages=MESSAGES, tools=[WEATHER], **NO_THINKING
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    [block] = final.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == ARGUMENTS
    assert final.stop_reason == "tool_use"
    # The next turn sends the call and its result back; they land in the prompt.
    scripted.expect("Sunny.")
    follow = [
        *MESSAGES,
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
    ]
    answer = create(client, messages=follow, tools=[WEATHER], **NO_THINKING)
    assert answer.content[0].text == "Sunny."


def test_tool_choice_any_makes_the_random_model_use_a_tool(client: anthropic.Anthropic) -> None:
    message = create(
        client,
        tools=[MODE],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
        **NO_THINKING,
    )
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert (
        block.name == "set_mode" and block.input["mode"] in ("fast", "slow") and isinstance(block.input["level"], int)
    )
    assert message.stop_reason == "tool_use"


def test_max_tokens_and_stop_sequences_are_reported(scripted: ScriptedCore, client: anthropic.Anthropic) -> None:
    scripted.expect("It will be sunny in Paris for the next three days.")
    assert create(client, max_tokens=3, **NO_THINKING).stop_reason == "max_tokens"
    scripted.expect("It will be sunny in Paris for the next three days.")
    message = create(client, stop_sequences=["Paris"], **NO_THINKING)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert message.content[0].text == "It will be sunny in "


def test_errors_have_anthropics_shape(server: InProcessServer, client: anthropic.Anthropic) -> None:
    # (the SDK itself refuses a request without max_tokens, so this one goes by hand)
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    no_max = HTTP.post(
        server.url("/v1/messages"), headers=headers, json={"model": DEMO_MODEL_NAME, "messages": MESSAGES}, timeout=30
    )
    assert no_max.status_code == 400 and no_max.json()["type"] == "error"
    assert (
        no_max.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in no_max.json()["error"]["message"]
    )
    with pytest.raises(anthropic.NotFoundError) as error:
        create(client, model="claude-not-served")
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=server.url(""), api_key="wrong", max_retries=0).messages.create(
            model=DEMO_MODEL_NAME, max_tokens=5, messages=MESSAGES
        )
    assert denied.value.body["error"]["type"] == "authentication_error"
    # Bearer works as well as x-api-key.
    reply = HTTP.post(
        server.url("/v1/messages/count_tokens"),
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": DEMO_MODEL_NAME, "messages": MESSAGES},
        timeout=30,
    )
    assert reply.status_code == 200 and reply.json()["input_tokens"] > 0


def test_thinking_reaches_the_template_and_count_tokens_sees_it(client: anthropic.Anthropic) -> None:
    def count(**kwargs: Any) -> int:
        return client.messages.count_tokens(model=DEMO_MODEL_NAME, messages=MESSAGES, **kwargs).input_tokens

    # Qwen3's template closes an empty think block in the prompt when thinking is off.
    enabled = count(thinking={"type": "enabled", "budget_tokens": 1024})
    assert count(thinking={"type": "disabled"}) > enabled
    assert count(thinking={"type": "enabled", "budget_tokens": 1024}, tools=[WEATHER]) > enabled  # tools render too
