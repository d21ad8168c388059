"""The typed request models: OpenAI's ranges as validators, a validation error as OpenAI's 400
body with `param` from the error's location, and /openapi.json generated from the models."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from api.access.limits import RequestLimits
from api.app import ServerConfig, build_app
from api.errors import APIError
from api.ops.openapi import openapi_schema
from api.request.models import ChatCompletionRequest
from api.request.validation import validate
from engine.config import EngineConfig

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"temperature": 9}, "temperature", "at most 2"),
        ({"top_p": 1.5}, "top_p", "at most 1"),
        ({"presence_penalty": -3}, "presence_penalty", "at least -2"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
        ({"stream_options": []}, "stream_options", "object"),
        ({"max_tokens": "10"}, "max_tokens", "integer"),
        ({"n": 2.5}, "n", "integer"),
        ({"seed": True}, "seed", "integer"),
        ({"stop": ["a", 1]}, "stop", "list of strings"),
    ],
)
def test_a_field_error_names_its_location(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(APIError) as info:
        validate(ChatCompletionRequest, {**body, "messages": MESSAGES})
    err = info.value
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert says in err.message and param.split(".")[0] in err.message


def test_unknown_fields_are_ignored_and_null_is_absent() -> None:
    m = validate(
        ChatCompletionRequest,
        {"temperature": None, "user": "u", "store": True, "max_tokens": 12.0, "messages": MESSAGES},
    )
    assert m.temperature is None and m.max_tokens == 12


def test_openapi_describes_each_request_body_with_its_ranges() -> None:
    doc = openapi_schema("1.2.3")
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    chat = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    temperature = chat["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
    responses = doc["components"]["schemas"]["ResponsesRequestModel"]["properties"]
    assert responses["max_output_tokens"]["anyOf"][0]["minimum"] == 1
    assert doc["info"]["version"] == "1.2.3"


def test_openapi_json_is_served_while_the_model_loads() -> None:
    never = lambda config: (_ for _ in ()).throw(AssertionError("not loaded in this test"))  # noqa: E731
    app = build_app(ServerConfig(engine=EngineConfig()), loader=never)
    with TestClient(app) as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200 and response.json()["openapi"] == "3.1.0"


@pytest.mark.parametrize(
    ("body", "param", "flag"),
    [
        ({"n": 3}, "n", "--max-n"),
        ({"stop": ["a", "b", "c"]}, "stop", "--max-stop"),
        ({"stop": "abcdef"}, "stop", "--max-stop-length"),
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids", "--max-stop"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs", "--max-logprobs"),
        ({"tools": [TOOL, TOOL]}, "tools", "--max-tools"),
    ],
)
def test_server_limits_are_validators_naming_the_flag(body: dict[str, Any], param: str, flag: str) -> None:
    limits = RequestLimits(max_n=2, max_output_tokens=8, max_stop=2, max_stop_length=5, max_logprobs=2, max_tools=1)
    with pytest.raises(APIError) as info:
        validate(ChatCompletionRequest, {**body, "messages": MESSAGES}, limits)
    assert info.value.param == param and flag in info.value.message
    validate(ChatCompletionRequest, {**body, "messages": MESSAGES})  # within the default limits


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_output_tokens_caps_rather_than_refuses(field: str) -> None:
    # The cap applies where max_tokens is resolved (engine/front/input_processor.py): a body asking for
    # more is valid, and runs with the cap.
    limits = RequestLimits(max_output_tokens=8)
    chat = validate(ChatCompletionRequest, {field: 9, "messages": MESSAGES}, limits)
    assert chat.to_sampling_params().max_tokens == 9
