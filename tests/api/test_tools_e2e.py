"""Tool calls end to end: a real server (api.server.Server under hypercorn on 127.0.0.1, in this
process) with --tool-parser qwen3 / qwen3_coder and --reasoning-parser qwen3, read with the
official `openai` SDK. The demo model's sampled tokens follow a script (the tokenizer's encoding
of a model answer, then <|im_end|>), so each test knows exactly what the model "wrote": the SDK's
stream helper must end with the right calls and typed arguments, reasoning beside them, indices 0
and 1 for parallel calls, and finish_reason "tool_calls" — or "length" when max_tokens cuts a call.

The last tests drive the unscripted random model with tool_choice "required" / a named function,
which the engine enforces (a tool_calls `StructuredOutput`, engine/grammars/tools.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from api.app import ServerConfig
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_types import SampledToken
from engine.front.async_engine import AsyncEngine
from engine.front.tokenizer import Tokenizer
from engine.model_runner import StepResult
from engine.weights.demo_model import DEMO_MODEL_NAME, EOS_TOKEN_ID
from scheduler.output import SchedulerOutput
from tests.server_utils import InProcessServer, in_process_server

ENGINE = EngineConfig(kv_cache_memory="32MiB", max_model_len=2048)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "function",
    "function": {
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
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}
THINK = "<think>\nI should call it.\n</think>\n\n"


def call_text(fmt: str, name: str, arguments: dict[str, Any]) -> str:
    """A call as each model family writes it."""
    if fmt == "qwen3":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


class ScriptedCore:
    """An EngineCore whose sampled tokens follow a script: each request that starts takes the
    next script queued with `expect` (the real forward still runs, and its KV holds the script).
    Requests that start with no script queued keep the model's own tokens."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._tokenizer = Tokenizer(core.model_path)
        self._lock = threading.Lock()  # `expect` runs on the test's thread, `execute` on the step thread
        self._queued: list[list[int]] = []
        self._scripts: dict[str, list[int]] = {}
        self._positions: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def expect(self, text: str) -> int:
        """Queue `text` + <|im_end|> for the next request; returns its number of tokens."""
        ids = self._tokenizer.encode(text, add_special_tokens=False) + [EOS_TOKEN_ID]
        with self._lock:
            self._queued.append(ids)
        return len(ids)

    def clear(self) -> None:
        with self._lock:
            self._queued.clear()

    def execute(self, out: SchedulerOutput) -> StepResult:
        result = self._core.execute(out)
        with self._lock:
            for r in out.requests:
                if r.new_request is not None and self._queued:
                    self._scripts[r.request_id] = self._queued.pop(0)
        sampled = dict(result.sampled)
        for request_id in sampled:
            script = self._scripts.get(request_id)
            if script is not None:
                position = self._positions.get(request_id, 0)
                self._positions[request_id] = position + 1
                sampled[request_id] = SampledToken(script[min(position, len(script) - 1)])
        return StepResult(sampled, result.timings)


@contextmanager
def scripted_server(scripted: ScriptedCore, tool_parser: str, reasoning_parser: str) -> Iterator[InProcessServer]:
    """An in-process server on the scripted core. NOTE: each server wraps the shared core in a fresh
    AsyncEngine; the model loads once."""
    config = ServerConfig(engine=ENGINE, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    with in_process_server(config, loader=lambda _: AsyncEngine(scripted)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture(scope="module")
def scripted() -> ScriptedCore:
    return ScriptedCore(EngineCore(ENGINE))


@pytest.fixture(scope="module", params=["qwen3", "qwen3_coder"])
def server(request: pytest.FixtureRequest, scripted: ScriptedCore) -> Iterator[tuple[str, InProcessServer]]:
    with scripted_server(scripted, request.param, "qwen3") as running:
        yield request.param, running


@pytest.fixture
def fmt(server: tuple[str, InProcessServer], scripted: ScriptedCore) -> Iterator[str]:
    scripted.clear()
    yield server[0]
    scripted.clear()


@pytest.fixture
def client(server: tuple[str, InProcessServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1].url("/v1"), api_key="unused", max_retries=0, timeout=60)


def stream(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The stream helper's final completion and the raw chunks it was built from."""
    request = {"model": DEMO_MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 400, **kwargs}
    with client.chat.completions.stream(**request) as events:
        chunks = [event.chunk for event in events if event.type == "chunk"]
        return events.get_final_completion(), chunks


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ---- scripted answers -------------------------------------------------------------------------------------
def test_stream_helper_ends_with_the_call_and_its_typed_arguments(
    fmt: str, scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect(call_text(fmt, "get_weather", ARGUMENTS))
    completion, _ = stream(client)
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", ARGUMENTS)]
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    assert [type(arguments[k]) for k in ("days", "metric", "hours")] == [int, bool, list]
    assert not choice.message.content


def test_the_same_call_without_streaming(fmt: str, scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect(call_text(fmt, "get_weather", ARGUMENTS))
    completion = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=400)
    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(completion.choices[0].message) == [("get_weather", ARGUMENTS)]


def test_reasoning_and_the_call_arrive_together(fmt: str, scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect(THINK + call_text(fmt, "get_weather", ARGUMENTS))
    completion, chunks = stream(client)
    [choice] = completion.choices
    assert choice.message.reasoning_content == "I should call it."
    assert calls_of(choice.message) == [("get_weather", ARGUMENTS)]
    assert choice.finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning_at = [i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None)]
    call_at = [i for i, d in enumerate(deltas) if d.tool_calls]
    assert reasoning_at and call_at and max(reasoning_at) < min(call_at)  # the reasoning streams first


def test_with_thinking_disabled_there_is_no_reasoning_and_the_call_is_parsed(
    fmt: str, scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    scripted.expect(call_text(fmt, "get_weather", ARGUMENTS))
    completion, _ = stream(client, extra_body=NO_THINKING)
    [choice] = completion.choices
    assert getattr(choice.message, "reasoning_content", None) is None
    assert calls_of(choice.message) == [("get_weather", ARGUMENTS)]
    assert choice.finish_reason == "tool_calls"


def test_max_tokens_cutting_a_call_finishes_with_length(
    fmt: str, scripted: ScriptedCore, client: openai.OpenAI
) -> None:
    num_tokens = scripted.expect(call_text(fmt, "get_weather", ARGUMENTS))
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        stream(client, max_tokens=num_tokens - 6)  # ends inside the arguments
    [choice] = cut.value.completion.choices
    assert choice.finish_reason == "length"
    # The deltas already sent stay, and nothing the model did not write follows them: the
    # arguments are a strict prefix of the whole call's (no invented closing quote or brace).
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.dumps(ARGUMENTS).startswith(call.function.arguments) and call.function.arguments != json.dumps(
        ARGUMENTS
    )
    scripted.expect(call_text(fmt, "get_weather", ARGUMENTS))
    whole = client.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=num_tokens - 6, extra_body=NO_THINKING
    )
    # Not streamed: an unclosed call is no call; its text stays in content.
    assert whole.choices[0].finish_reason == "length"
    assert not whole.choices[0].message.tool_calls
    assert whole.choices[0].message.content.startswith("<tool_call>\n")
    assert call_text(fmt, "get_weather", ARGUMENTS).startswith(whole.choices[0].message.content)


def test_parallel_calls_get_indices_0_and_1(fmt: str, scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect(call_text(fmt, "get_weather", ARGUMENTS) + "\n" + call_text(fmt, "now", {}))
    completion, chunks = stream(client)
    [choice] = completion.choices
    assert calls_of(choice.message) == [("get_weather", ARGUMENTS), ("now", {})]
    assert [c.index for c in choice.message.tool_calls] == [0, 1]
    announced = [
        (d.index, d.function.name)
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
        if d.id is not None
    ]
    assert announced == [(0, "get_weather"), (1, "now")]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert choice.finish_reason == "tool_calls"


def test_an_answer_without_a_call_finishes_with_stop(fmt: str, scripted: ScriptedCore, client: openai.OpenAI) -> None:
    scripted.expect("It will be sunny in Paris.")
    completion, _ = stream(client, extra_body=NO_THINKING)
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content == "It will be sunny in Paris." and not choice.message.tool_calls


# ---- tool_choice enforced by a grammar, on the unscripted random model --------------------------------------
# Arguments the random model cannot run on forever: enums, integers and booleans only.
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
            },
            "required": ["mode", "level"],
        },
    },
}
BOUNDED_TOOLS = [MODE, NOW]


def random_model_answer(client: openai.OpenAI, max_tokens: int = 300, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        tools=BOUNDED_TOOLS,
        max_tokens=max_tokens,
        temperature=0,
        parallel_tool_calls=False,
        extra_body=NO_THINKING,
        **kwargs,
    ).choices[0]


def test_the_random_model_alone_makes_no_call(fmt: str, client: openai.OpenAI) -> None:
    # The contrast for the two tests below: without enforcement there is no call to find.
    assert not random_model_answer(client, max_tokens=40).message.tool_calls


def test_tool_choice_required_makes_the_random_model_call_an_offered_tool(fmt: str, client: openai.OpenAI) -> None:
    choice = random_model_answer(client, tool_choice="required")
    assert choice.finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(choice.message)
    assert name in ("set_mode", "now")
    if name == "set_mode":
        assert arguments["mode"] in ("fast", "slow") and isinstance(arguments["level"], int)
        assert set(arguments) <= {"mode", "level", "force"}
    else:
        assert arguments == {}


def test_a_named_function_is_the_one_the_random_model_calls(fmt: str, client: openai.OpenAI) -> None:
    choice = random_model_answer(client, tool_choice={"type": "function", "function": {"name": "set_mode"}})
    assert choice.finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(choice.message)
    assert name == "set_mode" and arguments["mode"] in ("fast", "slow") and isinstance(arguments["level"], int)
