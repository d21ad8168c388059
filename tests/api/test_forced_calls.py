"""A forced tool call is a call, on all three APIs, through the official SDKs against a real server
(hypercorn on 127.0.0.1, in this process) on the demo's random-weight Qwen3 with --tool-parser
qwen3 and --reasoning-parser qwen3:

- tool_choice any / required / named ends at the call or calls: stop_reason "tool_use",
  finish_reason "tool_calls", status completed; with parallel calls off exactly one call;
- a forced call cut by the token limit comes back as an incomplete call (the arguments so far),
  never as the template's markup in the text;
- a grammar that cannot be built or compiled fails visibly: a 500 in the protocol's shape, or an
  SSE error event once streaming, a log line and fp4serve_grammar_failures_total by reason;
- under load (concurrent compiles, a slow one), every forced request gets its call or an
  incomplete call, never text.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
import pytest

from api.app import ServerConfig
from engine.core import EngineCore
from engine.front.async_engine import AsyncEngine
from engine.weights.demo_model import DEMO_MODEL_NAME
from scheduler.structured_output import StructuredOutput
from tests.api.test_tools_e2e import ENGINE
from tests.server_utils import HTTP, InProcessServer, in_process_server, metric

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING_CHAT = {"chat_template_kwargs": {"enable_thinking": False}}
NO_THINKING = {"type": "disabled"}


def mode_tool(name: str = "set_mode") -> dict[str, Any]:
    """A function whose arguments the random model cannot run on forever: an enum and an integer."""
    return {
        "name": name,
        "input_schema": {
            "type": "object",
            "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
            "required": ["mode", "level"],
        },
    }


NOW = {"name": "now", "input_schema": {"type": "object", "properties": {}}}
ANTHROPIC_TOOLS = [mode_tool(), NOW]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in tools]


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "parameters": t["input_schema"]} for t in tools]


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(ENGINE)


@pytest.fixture(scope="module")
def server(core: EngineCore) -> Iterator[InProcessServer]:
    config = ServerConfig(engine=ENGINE, tool_parser="qwen3", reasoning_parser="qwen3")
    with in_process_server(config, loader=lambda _: AsyncEngine(core)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def claude(server: InProcessServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def oai(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def message(
    claude: anthropic.Anthropic,
    max_tokens: int,
    tools: list[dict[str, Any]] = ANTHROPIC_TOOLS,
    tool_choice: dict[str, Any] | None = None,
    **sampling: Any,
) -> Any:
    return claude.messages.create(
        model=DEMO_MODEL_NAME,
        max_tokens=max_tokens,
        messages=MESSAGES,
        tools=tools,
        tool_choice=tool_choice or {"type": "any"},
        thinking=NO_THINKING,
        extra_body=sampling,
    )


def chat(oai: openai.OpenAI, max_tokens: int, tools: list[dict[str, Any]] = ANTHROPIC_TOOLS, **kwargs: Any) -> Any:
    return oai.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        tools=chat_tools(tools),
        max_tokens=max_tokens,
        tool_choice="required",
        **kwargs,
        extra_body={**NO_THINKING_CHAT, **kwargs.pop("extra_body", {})},
    )


def response(oai: openai.OpenAI, max_tokens: int, tools: list[dict[str, Any]] = ANTHROPIC_TOOLS, **kwargs: Any) -> Any:
    return oai.responses.create(
        model=DEMO_MODEL_NAME,
        input=MESSAGES[0]["content"],
        tools=responses_tools(tools),
        tool_choice="required",
        max_output_tokens=max_tokens,
        **kwargs,
    )


def is_incomplete_json(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return True
    return False


# ---- Messages: tool_choice any ends at the calls ---------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_with_parallel_calls_writes_tool_use_blocks_only(claude: anthropic.Anthropic, seed: int) -> None:
    # The random model never chooses to stop on its own: it calls until max_tokens, and the call
    # the limit cuts is an incomplete tool_use block, not the template's markup as text.
    reply = message(claude, 150, seed=seed, temperature=1.0)
    assert [b.type for b in reply.content] and {b.type for b in reply.content} == {"tool_use"}
    assert reply.stop_reason in ("tool_use", "max_tokens")
    assert all(b.name in ("set_mode", "now") and isinstance(b.input, dict) for b in reply.content)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_without_parallel_calls_is_one_call_then_the_end(claude: anthropic.Anthropic, seed: int) -> None:
    reply = message(
        claude, 150, tool_choice={"type": "any", "disable_parallel_tool_use": True}, seed=seed, temperature=1.0
    )
    [block] = reply.content
    assert block.type == "tool_use" and block.name in ("set_mode", "now")
    assert reply.stop_reason == "tool_use"


def test_a_named_tool_is_one_call_of_it_then_the_end(claude: anthropic.Anthropic) -> None:
    reply = message(claude, 150, tool_choice={"type": "tool", "name": "set_mode"}, temperature=0.0)
    [block] = reply.content
    assert (
        block.name == "set_mode" and block.input["mode"] in ("fast", "slow") and isinstance(block.input["level"], int)
    )
    assert reply.stop_reason == "tool_use"


# ---- chat and Responses: calls only, then the end ------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_required_with_parallel_calls_streams_calls_only(oai: openai.OpenAI, seed: int) -> None:
    request = dict(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        tools=chat_tools(ANTHROPIC_TOOLS),
        max_tokens=150,
        tool_choice="required",
        seed=seed,
        temperature=1.0,
        extra_body=NO_THINKING_CHAT,
    )
    with oai.chat.completions.stream(**request) as events:
        chunks = [event.chunk for event in events if event.type == "chunk"]
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)  # no text, not even markup
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["tool_calls"], ["length"])
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


def test_required_without_parallel_calls_is_one_call_with_finish_reason_tool_calls(oai: openai.OpenAI) -> None:
    for seed in (0, 1):
        [choice] = chat(oai, 150, parallel_tool_calls=False, seed=seed, temperature=1.0).choices
        [call] = choice.message.tool_calls
        assert call.function.name in ("set_mode", "now") and isinstance(json.loads(call.function.arguments), dict)
        assert choice.finish_reason == "tool_calls" and not choice.message.content


def test_responses_required_without_parallel_calls_completes_with_one_function_call(oai: openai.OpenAI) -> None:
    reply = response(oai, 150, parallel_tool_calls=False, temperature=0.0)
    assert reply.status == "completed"
    [item] = reply.output
    assert item.type == "function_call" and item.status == "completed" and item.name in ("set_mode", "now")
    assert isinstance(json.loads(item.arguments), dict)


# ---- a forced call cut by the token limit is an incomplete call -----------------------------------------------
CUT = 45  # tokens: the random model is inside the first call's arguments by then (its name is out)


def test_chat_cut_call_is_a_partial_tool_call_with_finish_reason_length(oai: openai.OpenAI) -> None:
    [choice] = chat(oai, CUT, temperature=0.0).choices
    assert choice.finish_reason == "length"
    assert not choice.message.content  # today: the template's "<tool_call>\n{..." as content
    [call] = choice.message.tool_calls
    assert call.function.name in ("set_mode", "now")
    assert call.function.arguments.startswith("{") and is_incomplete_json(call.function.arguments)


def test_streamed_chat_cut_call_is_the_same_partial_call(oai: openai.OpenAI) -> None:
    whole = chat(oai, CUT, temperature=0.0).choices[0].message.tool_calls[0]
    request = dict(
        model=DEMO_MODEL_NAME,
        messages=MESSAGES,
        tools=chat_tools(ANTHROPIC_TOOLS),
        max_tokens=CUT,
        tool_choice="required",
        temperature=0.0,
        extra_body=NO_THINKING_CHAT,
    )
    with pytest.raises(openai.LengthFinishReasonError) as cut, oai.chat.completions.stream(**request) as events:
        events.get_final_completion()
    [choice] = cut.value.completion.choices
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)


def test_responses_cut_call_is_an_incomplete_function_call_item(oai: openai.OpenAI) -> None:
    reply = response(oai, CUT, temperature=0.0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [item] = reply.output  # today: one `message` item holding the markup
    assert item.type == "function_call" and item.status == "incomplete" and item.name in ("set_mode", "now")
    assert item.arguments.startswith("{") and is_incomplete_json(item.arguments)


def test_messages_cut_call_is_a_tool_use_block_with_the_input_so_far(claude: anthropic.Anthropic) -> None:
    reply = message(claude, CUT, temperature=0.0)
    assert reply.stop_reason == "max_tokens"
    [block] = reply.content  # today: a text block with the markup
    assert block.type == "tool_use" and block.name in ("set_mode", "now")
    assert set(block.input) <= {"mode", "level"}
    streamed = []
    with claude.messages.stream(
        model=DEMO_MODEL_NAME,
        max_tokens=CUT,
        messages=MESSAGES,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        thinking=NO_THINKING,
        extra_body={"temperature": 0.0},
    ) as events:
        streamed = [e.content_block.type for e in events if e.type == "content_block_start"]
        final = events.get_final_message()
    assert streamed == ["tool_use"] and final.stop_reason == "max_tokens"
    assert final.content[0].input == block.input


# ---- a grammar that cannot be made fails visibly ----------------------------------------------------------------
def failures(server: InProcessServer, reason: str) -> float:
    text = HTTP.get(server.url("/metrics"), timeout=30).text
    return metric(text, f'fp4serve_grammar_failures_total{{reason="{reason}"}}', 0.0)


@pytest.fixture
def broken_builds(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our EBNF builder fails for a tool named broken_*: the grammar cannot be built."""
    compile_spec = core.structured.compiler.compile

    def compile_or_fail(spec: StructuredOutput) -> Any:
        if spec.kind == "tool_calls" and spec.tools[0].name.startswith("broken"):
            import engine.grammars.tools as tools

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(tools, "_json_call", lambda rules, tool: 1 / 0)
                return compile_spec(spec)
        return compile_spec(spec)

    monkeypatch.setattr(core.structured.compiler, "compile", compile_or_fail)


def test_a_grammar_that_cannot_be_built_is_a_500_in_each_protocols_shape(
    server: InProcessServer,
    oai: openai.OpenAI,
    claude: anthropic.Anthropic,
    broken_builds: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = failures(server, "build")
    with caplog.at_level(logging.ERROR, logger="fp4serve.structured"):
        with pytest.raises(openai.InternalServerError) as e:
            chat(oai, 40, tools=[mode_tool("broken_a")])
        assert e.value.status_code == 500 and "grammar could not be made (build)" in e.value.message
        with pytest.raises(anthropic.InternalServerError) as a:
            message(claude, 40, tools=[mode_tool("broken_b")])
        assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "api_error"
        assert "grammar could not be made" in a.value.body["error"]["message"]
        # Streamed, the 200 went out with the first event: the error is an SSE error event.
        events = list(
            oai.responses.create(
                model=DEMO_MODEL_NAME,
                input="hi",
                tools=responses_tools([mode_tool("broken_c")]),
                tool_choice="required",
                max_output_tokens=40,
                stream=True,
            )
        )
        assert events[-1].type == "error" and "grammar could not be made (build)" in events[-1].message
        assert not any(e.type == "response.output_text.delta" for e in events)
    assert (
        sum(
            r.name == "fp4serve.structured" and "its grammar could not be made (build" in r.getMessage()
            for r in caplog.records
        )
        == 3
    )
    assert failures(server, "build") == before + 3


def test_a_grammar_xgrammar_refuses_is_counted_as_compile(
    server: InProcessServer, core: EngineCore, oai: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.grammars as grammars

    original = grammars.tool_call_grammar
    monkeypatch.setattr(
        grammars,
        "tool_call_grammar",
        lambda spec: "root ::= undefined_rule" if spec.tools[0].name == "refused" else original(spec),
    )
    before = failures(server, "compile")
    with pytest.raises(openai.InternalServerError) as e:
        chat(oai, 40, tools=[mode_tool("refused")])
    assert "grammar could not be made (compile)" in e.value.message
    assert failures(server, "compile") == before + 1
    # The server goes on: the next forced request gets its call.
    assert chat(oai, 150, parallel_tool_calls=False, temperature=0.0).choices[0].finish_reason == "tool_calls"


# ---- under load: every forced request returns its call or an incomplete call ------------------------------------
def test_concurrent_compiles_and_a_slow_one_never_turn_a_forced_call_into_text(
    core: EngineCore, oai: openai.OpenAI, claude: anthropic.Anthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_spec = core.structured.compiler.compile

    def slow_for_one(spec: StructuredOutput) -> Any:
        if spec.kind == "tool_calls" and spec.tools[0].name == "slow_0":
            time.sleep(1.0)  # a slow compile (a large schema), not a synchronisation
        return compile_spec(spec)

    monkeypatch.setattr(core.structured.compiler, "compile", slow_for_one)
    # Distinct tool names: distinct grammars, all compiling at once, the slow one among them.
    calls: list[Callable[[], list[tuple[str, str, bool]]]] = []
    for i in range(9):
        tools = [mode_tool(f"slow_{i}" if i == 0 else f"load_{i}"), NOW]
        max_tokens = CUT if i % 2 else 150
        if i % 3 == 0:
            calls.append(
                lambda tools=tools, m=max_tokens: [
                    ("chat", c.function.name, is_incomplete_json(c.function.arguments))
                    for c in _chat_calls(chat(oai, m, tools=tools, temperature=1.0, seed=7))
                ]
            )
        elif i % 3 == 1:
            calls.append(
                lambda tools=tools, m=max_tokens: [
                    ("responses", item.name, item.status == "incomplete")
                    for item in _items(response(oai, m, tools=tools, temperature=1.0))
                ]
            )
        else:
            calls.append(
                lambda tools=tools, m=max_tokens: [
                    ("messages", block.name, False)
                    for block in _blocks(message(claude, m, tools=tools, temperature=1.0))
                ]
            )
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: call(), calls))
    for got in answers:
        assert got, "a forced request came back with no call"
        assert all(name.startswith(("slow_", "load_", "now")) for _, name, _ in got)
        assert not any(incomplete for _, _, incomplete in got[:-1]), "only the last call can be cut"


def _chat_calls(completion: Any) -> list[Any]:
    [choice] = completion.choices
    assert not choice.message.content, f"text in a forced call's answer: {choice.message.content!r}"
    assert choice.finish_reason in ("tool_calls", "length")
    return choice.message.tool_calls or []


def _items(reply: Any) -> list[Any]:
    assert all(item.type == "function_call" for item in reply.output), [item.type for item in reply.output]
    assert reply.status in ("completed", "incomplete")
    return reply.output


def _blocks(reply: Any) -> list[Any]:
    assert all(block.type == "tool_use" for block in reply.content), [block.type for block in reply.content]
    assert reply.stop_reason in ("tool_use", "max_tokens")
    return reply.content


# ---- no stall: the compiler's tables exist before the first constrained request --------------------------------
def test_the_grammar_compiler_is_built_when_the_engine_is(core: EngineCore) -> None:
    # EngineCore returned (the engine is ready): the tokenizer tables were built while the model
    # loaded, so no constrained request builds them under the GIL while other streams run.
    assert core.structured.compiler.wait(timeout=0)
    assert core.structured.compiler._compiler is not None


def test_the_first_grammar_bench_reports_both_gaps(server: InProcessServer) -> None:
    import asyncio

    from bench.first_grammar import Scenario, format_result, run

    result = asyncio.run(run(Scenario(server.url("/v1"), DEMO_MODEL_NAME, None, stream_tokens=24, constrained_after=4)))
    assert result["largest_gap_ms_without"] > 0 and result["largest_gap_ms_with_first_constrained"] > 0
    assert result["constrained_request_s"] > 0 and "largest inter-token gap" in format_result(result)


# ---- the forced parser, both tool formats (no server) -----------------------------------------------------------
@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_forced_parser_keeps_a_cut_call_and_never_makes_content(fmt: str, streaming: bool) -> None:
    from api.parsers.output_parser import OutputParser, assemble
    from tests.api.test_tools_e2e import call_text

    tools = chat_tools(ANTHROPIC_TOOLS)
    whole = call_text(fmt, "set_mode", {"mode": "slow", "level": 3}) + "\n" + call_text(fmt, "now", {})
    second = whole.index("\n<tool_call>")
    for cut, names in [(second - 20, ["set_mode"]), (second + 5, ["set_mode"]), (len(whole) - 14, ["set_mode", "now"])]:
        parser = OutputParser(fmt, None, tools, False, streaming=streaming, forced=True)
        deltas = [parser.feed(whole[:cut]), parser.finish()]
        answer = assemble(deltas)
        assert answer.content is None, f"cut at {cut}: markup as content {answer.content!r}"
        assert [c.name for c in answer.tool_calls] == names
        assert parser.finish_reason("length") == "length"
    unforced = OutputParser(fmt, None, tools, False, streaming=False)
    assert assemble([unforced.feed(whole[: second - 20]), unforced.finish()]).content  # the contrast: markup as text
