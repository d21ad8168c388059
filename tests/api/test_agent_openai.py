"""Chat, Responses and completions as coding agents meet them (issues 26 and 32), through a real
server (hypercorn on 127.0.0.1, in this process) and the official `openai` SDK: max_tokens beyond
the room (clamped, or OpenAI's context_length_exceeded), Codex's namespace tools there and back,
system and developer items anywhere, forced calls of the random demo model within 200 tokens, the
refused request's log line and metric, deep tool schemas refused cleanly, /v1/models without the
cache path, and oversized prompts refused before the tokenizer runs. Scripted answers come from
tests/api/test_tools_e2e.py's ScriptedCore."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from engine.core import EngineCore
from engine.weights.demo_model import DEMO_MODEL_NAME
from tests.api.test_tools_e2e import ENGINE, ScriptedCore, call_text, scripted_server
from tests.server_utils import HTTP, InProcessServer, metric

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MODE_PARAMETERS = {
    "type": "object",
    "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
    "required": ["mode", "level"],
}
MODE = {"type": "function", "function": {"name": "set_mode", "parameters": MODE_PARAMETERS}}
# What Codex 0.169 sends (tests/agents has the captured request): functions, its sub-agent namespace,
# and a hosted web search this server does not run.
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn a sub-agent",
            "strict": False,
            "parameters": MODE_PARAMETERS,
        },
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]},
        },
    ],
}
CODEX_TOOLS = [EXEC, AGENTS, {"type": "web_search", "external_web_access": False}]
SPAWN = {"mode": "fast", "level": 2}


@pytest.fixture(scope="module")
def scripted() -> ScriptedCore:
    return ScriptedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module")
def server(scripted: ScriptedCore) -> Iterator[InProcessServer]:
    with scripted_server(scripted, "auto", "auto") as running:
        yield running


@pytest.fixture
def client(server: InProcessServer, scripted: ScriptedCore) -> Iterator[openai.OpenAI]:
    scripted.clear()
    yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    scripted.clear()


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        **{"model": DEMO_MODEL_NAME, "messages": MESSAGES, "max_tokens": 100, **kwargs}
    )


def long_prompt(words: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Summarise this:" + " cat" * words}]


def prompt_tokens(server: InProcessServer, messages: list[dict[str, Any]]) -> int:
    reply = HTTP.post(server.url("/tokenize"), json={"model": DEMO_MODEL_NAME, "messages": messages}, timeout=60)
    return reply.json()["count"]


def spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """Every call's first argument to `owner.name`, which still runs."""
    calls: list[Any] = []
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


# ---- max_tokens against the context ---------------------------------------------------------------
def test_max_tokens_beyond_the_room_is_clamped_and_finishes_with_length(
    server: InProcessServer, scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    messages = long_prompt(1930)
    room = server.engine.info.max_model_len - prompt_tokens(server, messages)
    assert 0 < room < 200
    scripted.expect("It will be sunny in Paris. " * 40)
    reply = chat(client, messages=messages, max_tokens=32000)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == room


def test_with_the_reject_policy_the_overflow_is_openais_context_length_exceeded(
    server: InProcessServer, client: openai.OpenAI
) -> None:
    messages = long_prompt(1930)
    num_prompt, max_len = prompt_tokens(server, messages), server.engine.info.max_model_len
    server.engine.input_processor.max_tokens_policy = "reject"  # what --max-tokens-policy reject sets
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, messages=messages, max_tokens=32000)
    finally:
        server.engine.input_processor.max_tokens_policy = "clamp"
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "max_tokens")
    assert refused.value.body["message"] == (
        f"This model's maximum context length is {max_len} tokens. However, you requested {num_prompt + 32000} tokens "
        f"({num_prompt} in the messages, 32000 in the completion). Please reduce the length of the messages or "
        "completion."
    )


def test_a_prompt_too_long_alone_is_context_length_exceeded_on_chat_and_responses(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, messages=long_prompt(4000))
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    assert "maximum context length is" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=DEMO_MODEL_NAME, input=long_prompt(4000))
    assert (responses.value.code, responses.value.param) == ("context_length_exceeded", "input")


def test_oversized_chat_and_responses_prompts_are_refused_before_the_template_or_tokenizer_runs(
    server: InProcessServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = server.engine.input_processor
    rendered = spy(monkeypatch, inputs.tokenizer, "render_chat")
    encoded = spy(monkeypatch, inputs.tokenizer, "encode")
    huge = "x" * (inputs.max_model_len * inputs.chars_per_token + 1)  # more tokens than fit, whatever they are
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, messages=[{"role": "user", "content": huge}])
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    assert "resulted in at least" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=DEMO_MODEL_NAME, input=huge)
    assert (responses.value.code, responses.value.param) == ("context_length_exceeded", "input")
    assert rendered == encoded == []


# ---- Codex's namespace tools and developer items ---------------------------------------------------
def test_a_namespaced_call_comes_back_with_its_namespace_and_replays(
    server: InProcessServer, scripted: ScriptedCore, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted.expect(call_text("qwen3", "spawn_agent", SPAWN))
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        input="Spawn one.",
        tools=CODEX_TOOLS,
        reasoning={"effort": "none"},
        max_output_tokens=200,
    )
    [call] = [item.model_dump() for item in response.output if item.type == "function_call"]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("spawn_agent", "multi_agent_v1", SPAWN)
    # Codex's next turn replays the call as it got it, with the tool's output.
    rendered = spy(monkeypatch, server.engine.input_processor, "render_chat")
    scripted.expect("Spawned.")
    follow = client.responses.create(
        model=DEMO_MODEL_NAME,
        tools=CODEX_TOOLS,
        reasoning={"effort": "none"},
        max_output_tokens=50,
        input=[
            {"type": "message", "role": "user", "content": "Spawn one."},
            {
                "type": "function_call",
                "call_id": call["call_id"],
                "name": "spawn_agent",
                "namespace": "multi_agent_v1",
                "arguments": call["arguments"],
            },
            {"type": "function_call_output", "call_id": call["call_id"], "output": "agent 7 started"},
        ],
    )
    assert follow.output_text == "Spawned."
    [assistant] = [m for m in rendered[-1] if m["role"] == "assistant"]
    assert assistant["tool_calls"][0]["function"]["name"] == "spawn_agent"  # the name the model saw


def test_a_forced_call_to_a_namespaced_function_is_not_refused(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="fp4serve.api"):
        response = client.responses.create(
            model=DEMO_MODEL_NAME,
            input="Spawn one.",
            tools=CODEX_TOOLS,
            tool_choice={"type": "function", "name": "spawn_agent"},
            max_output_tokens=200,
            temperature=0,
        )
    [call] = [item.model_dump() for item in response.output if item.type == "function_call"]
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(call["arguments"])["mode"] in ("fast", "slow")
    assert any("tools of type web_search" in r.getMessage() for r in caplog.records)


def test_system_and_developer_items_may_stand_anywhere_in_responses_input(
    scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect("Fine.")
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        max_output_tokens=50,
        reasoning={"effort": "none"},
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills: none."}]},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "role": "system", "content": "Be brief."},
            {"type": "message", "role": "user", "content": "go on"},
        ],
    )
    assert response.output_text == "Fine."


# ---- forced calls on the random model --------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_a_forced_call_completes_within_200_tokens_on_chat_and_responses(client: openai.OpenAI, seed: int) -> None:
    reply = chat(client, max_tokens=200, tools=[MODE], tool_choice="required", parallel_tool_calls=False, seed=seed)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        input="Set it.",
        max_output_tokens=200,
        tools=[{"type": "function", "name": "set_mode", "parameters": MODE_PARAMETERS}],
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body={"seed": seed},
    )
    assert response.status == "completed" and [i.type for i in response.output][-1] == "function_call", response


# ---- refusals: logged, counted, clean --------------------------------------------------------------
def test_a_refused_request_leaves_one_log_line_and_counts_by_reason(
    server: InProcessServer, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    name = 'fp4serve_http_requests_rejected_total{reason="context_length_exceeded"}'
    before = metric(HTTP.get(server.url("/metrics")).text, name, 0.0)
    with caplog.at_level("INFO", logger="fp4serve.requests"), pytest.raises(openai.BadRequestError):
        chat(client, messages=long_prompt(4000))
    [line] = [r.getMessage() for r in caplog.records if r.name == "fp4serve.requests"]
    assert line.startswith(
        "refused POST /v1/chat/completions: 400 key=default code=context_length_exceeded "
        "param=messages client=127.0.0.1: This model's maximum context length is"
    )
    assert metric(HTTP.get(server.url("/metrics")).text, name) == before + 1
    caplog.clear()
    with caplog.at_level("INFO", logger="fp4serve.requests"):
        bad = HTTP.post(server.url("/v1/messages"), json={"model": DEMO_MODEL_NAME, "max_tokens": 5, "messages": []})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    [line] = [r.getMessage() for r in caplog.records if r.name == "fp4serve.requests"]
    assert line.startswith(
        "refused POST /v1/messages: 400 key=default code=invalid_request_error param=messages client=127.0.0.1:"
    )


def test_a_framing_refusal_is_logged_and_counted_once(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    # FramingMiddleware answers before any route; the request log outside it is the one place that
    # logs and counts, so a smuggling attempt is one line and one count.
    name = 'fp4serve_http_requests_rejected_total{reason="ambiguous_framing"}'
    before = metric(HTTP.get(server.url("/metrics")).text, name, 0.0)
    body = b"0\r\n\r\n"
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (len(body), body)
    )
    with caplog.at_level("INFO"), socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        sock.settimeout(30)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply
    [line] = [r.getMessage() for r in caplog.records if "Content-Length and Transfer-Encoding" in r.getMessage()]
    assert line.startswith("refused POST /v1/completions: 400 key=- code=ambiguous_framing param=- client=127.0.0.1:")
    assert metric(HTTP.get(server.url("/metrics")).text, name) == before + 1


def test_tool_schemas_nested_300_deep_are_a_clean_400(
    server: InProcessServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    rendered = spy(monkeypatch, server.engine.input_processor.tokenizer, "render_chat")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, tools=[{"type": "function", "function": {"name": "deep", "parameters": schema}}])
    assert rendered == []  # refused before the template, the tokenizer and any grammar compile
    assert refused.value.param == "tools[0].function.parameters"
    assert refused.value.body["message"] == "tools[0].function.parameters is nested deeper than 128 levels"


def test_models_lists_the_served_name_not_the_cache_path(client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == card.model_dump()["root"] == DEMO_MODEL_NAME


def test_oversized_completion_prompts_are_refused_before_the_tokenizer_runs(
    server: InProcessServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = server.engine.input_processor
    encoded = spy(monkeypatch, inputs.tokenizer, "encode")
    huge = "x" * (inputs.max_model_len * inputs.chars_per_token + 1)  # more tokens than fit, whatever they are
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=DEMO_MODEL_NAME, prompt=["fine"] * 63 + [huge], max_tokens=5)
    assert refused.value.code == "context_length_exceeded" and encoded == []
    # Under the bound but over the context: tokenizing stops at the first such prompt.
    too_many_tokens = " cat" * inputs.max_model_len
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=DEMO_MODEL_NAME, prompt=[too_many_tokens] * 64, max_tokens=5)
    assert encoded == [too_many_tokens]
