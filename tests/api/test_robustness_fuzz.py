"""Fuzzing the request schemas of /v1/chat/completions and /v1/completions against a live server
(hypothesis, a bounded derandomized run): whatever the body — plausible, half-right, wrong
types, huge numbers, not JSON at all — the answer is never a 5xx, every error is in OpenAI's
shape, every 200 is a well-formed completion or a stream without error events, and every valid
body is served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import DONE, RunningServer, metric, running_server, sse_event

pytestmark = pytest.mark.slow  # real servers in subprocesses: `make test-fast` skips them

MODEL = "fp4serve-demo-qwen3"
FINISH_REASONS = {"stop", "length", "tool_calls"}
FUZZ = settings(
    max_examples=70,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # Small limits keep every valid example to a couple of engine steps.
    with running_server(
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "32MiB",
        "--max-output-tokens",
        "2",
        "--max-n",
        "2",
        "--max-request-bytes",
        "65536",
        "--tool-parser",
        "auto",
        "--reasoning-parser",
        "qwen3",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


# ---- strategies -------------------------------------------------------------------------------------
# Valid bodies (which must be served), and the same bodies with one or two fields, top-level or
# inside a message, replaced by any JSON at all (which must be served or refused cleanly).
scalars = (
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=12)
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
VOCAB = 151_669  # the demo tokenizer's; the model's embedding has padding rows past it
text = st.text(max_size=20)
words = st.text(min_size=1, max_size=20)
token_id = st.integers(0, VOCAB - 1)


@st.composite
def corrupted(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], fields: list[str]) -> dict[str, Any]:
    body = dict(draw(valid))
    for key in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        body[key] = draw(anything)
    return body


def messages_of(corrupt: bool) -> st.SearchStrategy[list[dict[str, Any]]]:
    plain = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": text
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]), "text": text}), max_size=2
            ),
        }
    )
    call = st.fixed_dictionaries(
        {
            "id": words,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["get_time", "f"]),
                    "arguments": st.sampled_from(['{"x": 1}', "{}", '{"trunc']),
                }
            ),
        }
    )
    assistant = st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={"content": text, "tool_calls": st.lists(call, min_size=1, max_size=2), "reasoning_content": text},
    )
    tool_reply = st.fixed_dictionaries({"role": st.just("tool"), "content": text, "tool_call_id": words})
    message = plain | assistant | tool_reply
    if corrupt:
        message = corrupted(message, ["role", "content", "tool_calls", "tool_call_id", "name"]) | message
    user = st.fixed_dictionaries({"role": st.just("user"), "content": words})
    return st.tuples(st.lists(message, max_size=2), user).map(lambda parts: [*parts[0], parts[1]])


tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["get_time", "f"])},
                optional={
                    "description": text,
                    "parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}}),
                },
            ),
        }
    ),
    min_size=1,
    max_size=2,
)
sampling = {
    "model": st.just(MODEL),
    "n": st.integers(1, 2),
    "max_tokens": st.integers(1, 2),
    "min_tokens": st.integers(0, 1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1),
    "stop": words | st.lists(words, max_size=2),
    "stop_token_ids": st.lists(token_id, max_size=2),
    "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.just({"type": "text"}),
    "return_token_ids": st.booleans(),
}
valid_chats = st.fixed_dictionaries(
    {"messages": messages_of(corrupt=False)},
    optional={
        **sampling,
        "logprobs": st.just(True),
        "top_logprobs": st.integers(0, 20),
        "tools": tools,
        "tool_choice": st.sampled_from(["none", "auto"]),
        "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
        "enable_thinking": st.booleans(),
    },
).map(lambda body: {**body, "logprobs": True} if "top_logprobs" in body else body)
valid_completions = st.fixed_dictionaries(
    {"prompt": words | st.lists(words, min_size=1, max_size=2) | st.lists(token_id, min_size=1, max_size=6)},
    optional={**sampling, "logprobs": st.integers(0, 5), "echo": st.booleans(), "prompt_logprobs": st.integers(0, 3)},
)
CHAT_FIELDS = [
    *sampling,
    "messages",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "enable_thinking",
    "add_generation_prompt",
    "max_completion_tokens",
]
COMPLETION_FIELDS = [*sampling, "prompt", "logprobs", "echo", "prompt_logprobs", "suffix"]
bad_chats = corrupted(valid_chats, CHAT_FIELDS) | st.fixed_dictionaries({"messages": messages_of(corrupt=True)})
bad_completions = corrupted(valid_completions, COMPLETION_FIELDS)
raw_bodies = st.one_of(
    st.binary(max_size=64),
    anything.map(lambda v: json.dumps(v).encode()),
    valid_chats.map(lambda b: json.dumps(b).encode()[:-3]),
)  # truncated JSON


# ---- checks ---------------------------------------------------------------------------------------------
def check_error(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert "Traceback" not in error["message"]


def check_stream(response: httpx.Response) -> None:
    events = [e for line in response.iter_lines() if (e := sse_event(line)) is not None]
    assert events and events[-1] == DONE, events
    chunks = events[:-1]
    assert not any("error" in e for e in chunks), chunks
    finished = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finished and set(finished) <= FINISH_REASONS, chunks


def check(response: httpx.Response, streamed: bool) -> None:
    if response.status_code != 200:
        response.read()
        check_error(response)
    elif streamed:
        check_stream(response)
    else:
        body = orjson.loads(response.read())
        assert body["choices"] and {c["finish_reason"] for c in body["choices"]} <= FINISH_REASONS, body
        assert body["usage"]["completion_tokens"] >= len(body["choices"])


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> int:
    # NOTE: the stdlib encoder, not orjson: it writes integers past 64 bits, which clients do send.
    content = json.dumps(body).encode()
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as response:
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        check(response, streamed)
        return response.status_code


# ---- the fuzz tests --------------------------------------------------------------------------------------
@settings(FUZZ, max_examples=50)  # each valid example runs the engine: fewer of them
@given(body=valid_chats)
def test_every_valid_chat_body_is_served(http: httpx.Client, body: dict[str, Any]) -> None:
    assert post(http, "/v1/chat/completions", body) == 200


@FUZZ
@given(body=bad_chats)
def test_any_chat_body_gets_a_completion_or_an_openai_error(http: httpx.Client, body: dict[str, Any]) -> None:
    post(http, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=40)
@given(body=valid_completions)
def test_every_valid_completion_body_is_served(http: httpx.Client, body: dict[str, Any]) -> None:
    assert post(http, "/v1/completions", body) == 200


@FUZZ
@given(body=bad_completions)
def test_any_completion_body_gets_a_completion_or_an_openai_error(http: httpx.Client, body: dict[str, Any]) -> None:
    post(http, "/v1/completions", body)


@settings(FUZZ, max_examples=30)
@given(content=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_bodies_that_are_not_a_request_object_get_an_openai_error(
    http: httpx.Client, content: bytes, path: str
) -> None:
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    check_error(response)
    assert response.status_code in (400, 404)  # 404: a JSON object naming another model


def test_the_fuzzed_server_is_idle_and_healthy_afterwards(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    text = http.get("/metrics").text
    assert metric(text, "fp4serve_num_requests_running") == metric(text, "fp4serve_kv_cache_usage_ratio") == 0
