"""/v1/responses through a real server (hypercorn on 127.0.0.1, in this process) with the official
`openai` SDK: `responses.create`, `responses.stream`, function tools with tool_choice "required",
max_output_tokens, and the store (previous_response_id, GET, DELETE). Scripted answers come from
tests/api/test_tools_e2e.py's ScriptedCore (the demo model's sampled tokens follow a script)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from api.app import ServerConfig
from api.responses.store import ResponseStore, StoredResponse, owner_of
from engine.core import EngineCore
from engine.front.async_engine import AsyncEngine
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.api.test_tools_e2e import ARGUMENTS, ENGINE, THINK, ScriptedCore, call_text
from tests.server_utils import InProcessServer, in_process_server

KEY = "sk-responses-test"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "parameters": {
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
    "type": "function",
    "name": "set_mode",
    "parameters": {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
        "required": ["mode", "level"],
    },
}
NO_THINKING = {"reasoning": {"effort": "none"}}


@pytest.fixture(scope="module")
def scripted() -> ScriptedCore:
    return ScriptedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module")
def server(scripted: ScriptedCore) -> Iterator[InProcessServer]:
    config = ServerConfig(
        engine=ENGINE, tool_parser="qwen3", reasoning_parser="qwen3", api_key=KEY, responses_store_size=4
    )
    with in_process_server(config, loader=lambda _: AsyncEngine(scripted)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def client(server: InProcessServer, scripted: ScriptedCore) -> Iterator[openai.OpenAI]:
    scripted.clear()
    yield openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    scripted.clear()


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=DEMO_MODEL_NAME, **{"max_output_tokens": 300, **kwargs})


def test_create_returns_text_reasoning_and_usage(scripted: ScriptedCore, client: openai.OpenAI) -> None:
    num_tokens = scripted.expect(THINK + "It will be sunny in Paris.")
    response = create(client, input="Weather in Paris?", instructions="Be brief.")
    assert response.status == "completed" and response.object == "response"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I should call it."
    assert message.type == "message" and response.output_text == "It will be sunny in Paris."
    assert response.usage.output_tokens == num_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + num_tokens > num_tokens
    assert response.instructions == "Be brief."


def test_input_items_with_a_call_and_its_output_render_into_the_prompt(
    scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect("Sunny.")
    plain = create(client, input="Weather in Paris?", **NO_THINKING)
    scripted.expect("Sunny.")
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    with_call = create(client, input=items, tools=[WEATHER], **NO_THINKING)
    assert with_call.output_text == "Sunny."
    assert with_call.usage.input_tokens > plain.usage.input_tokens + 10  # the call and its result are in it


def test_stream_sends_the_sdk_event_sequence_and_ends_with_the_call(
    scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect(THINK + "Let me look.\n" + call_text("qwen3", "get_weather", ARGUMENTS))
    with client.responses.stream(
        model=DEMO_MODEL_NAME, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=300
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    assert compact == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == ARGUMENTS
    assert final.output_text == "Let me look."


def test_tool_choice_required_makes_the_random_model_call_an_offered_function(client: openai.OpenAI) -> None:
    response = create(
        client,
        input="Set a mode.",
        tools=[MODE],
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        **NO_THINKING,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    arguments = json.loads(call.arguments)
    assert call.name == "set_mode" and arguments["mode"] in ("fast", "slow") and isinstance(arguments["level"], int)


def test_text_format_json_object_gives_json(client: openai.OpenAI) -> None:
    response = create(
        client,
        input="Answer in JSON.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=200,
        **NO_THINKING,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # the random model may run out of tokens inside the object; what it wrote is still JSON so far
        assert response.output_text.lstrip().startswith("{")


def test_max_output_tokens_makes_it_incomplete_in_both_shapes(scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect("It will be sunny in Paris for the next three days.")
    response = create(client, input="Weather?", max_output_tokens=3, **NO_THINKING)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    scripted.expect("It will be sunny in Paris for the next three days.")
    with client.responses.stream(model=DEMO_MODEL_NAME, input="Weather?", max_output_tokens=3, **NO_THINKING) as s:
        kinds = [event.type for event in s]
    assert kinds[-1] == "response.incomplete"


def test_store_previous_response_id_get_and_delete(scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect("Paris is in France.")
    first = create(client, input="Where is Paris?", **NO_THINKING)
    assert client.responses.retrieve(first.id).output_text == "Paris is in France."
    scripted.expect("About two million people.")
    alone = create(client, input="How many people live there?", store=False, **NO_THINKING)
    scripted.expect("About two million people.")
    follow = create(client, input="How many people live there?", previous_response_id=first.id, **NO_THINKING)
    assert follow.previous_response_id == first.id
    # The earlier turn (question and answer) is in the prompt.
    assert follow.usage.input_tokens > alone.usage.input_tokens + 8
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=False
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="Hi", previous_response_id="resp_unknown")


def test_store_is_bounded_lru_and_private_to_the_creating_key() -> None:
    store = ResponseStore(2)
    alice, bob = owner_of(b"alice"), owner_of(b"bob")
    for name in ("a", "b"):
        store.put(name, StoredResponse(alice, {"id": name}, []))
    assert store.get("a", alice) is not None  # "a" is now the most recently used
    store.put("c", StoredResponse(alice, {"id": "c"}, []))
    assert store.get("b", alice) is None and len(store) == 2  # "b" was the least recently used
    assert store.get("a", bob) is None and not store.delete("a", bob)  # another key sees nothing
    assert store.delete("a", alice) and store.get("a", alice) is None
    ResponseStore(0).put("x", StoredResponse(alice, {}, []))  # size 0 stores nothing


def test_bad_input_is_a_400_naming_the_item(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        create(client, input=[{"type": "computer_call", "call_id": "x"}])
    assert "input[0].type" in str(error.value)


def test_a_call_cut_by_max_output_tokens_is_not_a_call(scripted: ScriptedCore, client: openai.OpenAI) -> None:
    text = call_text("qwen3", "get_weather", ARGUMENTS)
    num_tokens = scripted.expect(text)
    cut = {"input": "Weather?", "tools": [WEATHER], "max_output_tokens": num_tokens - 6, **NO_THINKING}
    whole = create(client, **cut)
    # Not streamed: no function_call item; the text the model wrote stays a message.
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["message"]
    assert whole.output_text.startswith("<tool_call>") and text.startswith(whole.output_text)
    scripted.expect(text)
    with client.responses.stream(model=DEMO_MODEL_NAME, **cut) as stream:
        events = list(stream)
    # Streamed: the deltas already sent stay, nothing is added, and the item ends incomplete.
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.status == "incomplete"
    assert json.dumps(ARGUMENTS).startswith(call.arguments) and call.arguments != json.dumps(ARGUMENTS)


def test_text_format_json_schema_is_enforced_on_the_random_model(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}},
        "required": ["mode"],
        "additionalProperties": False,
    }
    response = create(
        client,
        input="Pick a mode.",
        temperature=0,
        max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "mode", "schema": schema, "strict": True}},
        **NO_THINKING,
    )
    assert response.status == "completed"
    assert json.loads(response.output_text)["mode"] in ("fast", "slow")


def test_built_in_tools_are_left_out_and_function_tools_nested_for_chat() -> None:
    from api.grammars.response_format import ResponseFormat
    from api.request.validation import validate
    from api.responses.request import ResponsesRequestModel

    request = validate(
        ResponsesRequestModel,
        {
            "input": "hi",
            "tools": [{"type": "web_search"}, WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 7,
        },
    )
    chat = request.to_chat_request(history=[])
    assert [t["function"]["name"] for t in chat.tools] == ["get_weather"]
    assert chat.tools[0]["function"]["parameters"] == WEATHER["parameters"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.to_sampling_params().max_tokens == 7 and chat.messages == [{"role": "user", "content": "hi"}]
    formatted = validate(ResponsesRequestModel, {"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert formatted.to_chat_request(history=[]).response_format == ResponseFormat("json_object")


def test_an_agent_loop_call_then_its_output_by_previous_response_id(
    scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect(call_text("qwen3", "get_weather", ARGUMENTS))
    first = create(client, input="Weather in Paris?", tools=[WEATHER], **NO_THINKING)
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS
    scripted.expect("Sunny, 21 C.")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = create(client, input=[result], previous_response_id=first.id, tools=[WEATHER], **NO_THINKING)
    assert second.output_text == "Sunny, 21 C."
    # The same turn sent by hand (the call as an input item) renders the same prompt.
    scripted.expect("Sunny, 21 C.")
    by_hand = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    assert create(client, input=by_hand, tools=[WEATHER], **NO_THINKING).usage.input_tokens == second.usage.input_tokens
