"""The chat response shapes (api/openai/chat.py's ChatEncoder) through the pipeline's stream tail and body
(api/pipeline.py) on scripted engine outputs: chunk order and shape, the output parser hook
(reasoning, tool calls, finish reasons), and the OpenAI SDK assembling our stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from api.engine_stream import EngineStream
from api.openai.chat import ChatEncoder
from api.parsers import ParserSettings
from api.pipeline import Choices, ResponseHeader, Started, collect_body
from api.pipeline import stream_events as pipeline_events
from api.request.models import ChatCompletionRequest
from api.request.validation import validate
from engine.front.outputs import RequestOutput

HEADER = ResponseHeader(id="chatcmpl-test", created=1_700_000_000, model="demo")
PROMPT = [11, 12, 13]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

Responder = Callable[[AsyncIterator[RequestOutput]], Awaitable[tuple[Started, ChatEncoder]]]


def responder(parsers: ParserSettings = ParserSettings(), **body: Any) -> Responder:
    """What the chat route builds for this body, over a scripted engine stream."""
    chat: ChatCompletionRequest = validate(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body}
    )

    async def build(outputs: AsyncIterator[RequestOutput]) -> tuple[Started, ChatEncoder]:
        n = chat.n or 1
        choices = Choices(
            n,
            [
                parsers.make(chat.tools, chat.tool_choice, chat.calls_in_parallel, False, chat.streaming)
                for _ in range(n)
            ],
        )
        started = Started(HEADER, [PROMPT], False, EngineStream([outputs], None), choices, chat.streaming)
        return started, ChatEncoder(started, chat)

    return build


def outputs(pieces: list[str], finish: str = "stop", index: int = 0, error_at: int | None = None) -> Any:
    async def gen() -> AsyncIterator[RequestOutput]:
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(
                "r",
                index,
                (100 + i,),
                text,
                finish if last else None,
                len(PROMPT),
                i + 1,
                error="device lost" if i == error_at else None,
            )

    return gen()


def stream_events(r: Responder, outs: Any) -> list[Any]:
    async def collect() -> list[bytes]:
        started, encoder = await r(outs)
        return [event async for event in pipeline_events(started, encoder)]

    events = []
    for raw in asyncio.run(collect()):
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        data = raw[len(b"data: ") : -2]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def complete(r: Responder, outs: Any) -> dict[str, Any]:
    async def collect() -> dict[str, Any]:
        started, encoder = await r(outs)
        return await collect_body(started, encoder)

    return asyncio.run(collect())


def sdk_assembled(events: list[Any], tools: list[dict[str, Any]] | None = None) -> Any:
    state = ChatCompletionStreamState(input_tools=tools or [])
    for event in events[:-1]:
        state.handle_chunk(ChatCompletionChunk.construct(**event))
    return state.get_final_completion().choices[0]


def test_stream_is_role_then_one_chunk_per_output_then_usage_then_done() -> None:
    events = stream_events(responder(stream=True, stream_options={"include_usage": True}), outputs(["He", "llo", "!"]))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(c["id"], c["created"], c["object"]) for c in chunks} == {
        (HEADER.id, HEADER.created, "chat.completion.chunk")
    }
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": "He"}, {"content": "llo"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:4]] == [None, None, "stop"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:4])


def test_outputs_with_nothing_to_say_send_no_chunk() -> None:
    events = stream_events(responder(stream=True), outputs(["a", "", "", "b"]))
    assert [e["choices"][0]["delta"] for e in events[1:-1]] == [{"content": "a"}, {"content": "b"}]


def test_engine_error_mid_stream_becomes_an_error_event_then_done() -> None:
    events = stream_events(responder(stream=True), outputs(["a", "b", "c"], error_at=1))
    assert events[1]["choices"][0]["delta"] == {"content": "a"}
    assert events[2] == {"error": {"message": "device lost", "type": "server_error", "param": None, "code": None}}
    assert events[3:] == ["[DONE]"]


def test_stream_and_body_agree_without_a_parser() -> None:
    pieces = ["The ", "answer", " is 42."]
    events = stream_events(responder(stream=True), outputs(pieces))
    body = complete(responder(), outputs(pieces))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 42."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assembled = sdk_assembled(events)  # NOTE: the SDK helper refuses a `length` finish
    assert (assembled.message.content, assembled.finish_reason) == ("The answer is 42.", "stop")


REASONING_AND_CALL = [
    "<thi",
    "nk>\nLet me look",
    " it up.\n</th",
    "ink>\n\nSure.",
    "<tool_",
    'call>\n{"name": "get_',
    'weather", "arguments": {"ci',
    'ty": "Oslo"}}\n</tool_call>',
]


def test_reasoning_and_tool_calls_stream_through_the_output_parser() -> None:
    parsers = ParserSettings(tool_parser="qwen3", reasoning_parser="qwen3")
    events = stream_events(responder(parsers, stream=True, tools=TOOLS), outputs(REASONING_AND_CALL))
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert not any("<" in d.get("content", "") for d in deltas), deltas
    headers = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert len(headers) == 1 and headers[0]["type"] == "function" and headers[0]["function"]["name"] == "get_weather"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    choice = sdk_assembled(events, TOOLS)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    assert choice.message.model_extra["reasoning_content"].strip() == "Let me look it up."
    assert [(c.function.name, orjson.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    body = complete(responder(parsers, tools=TOOLS), outputs(REASONING_AND_CALL))["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] == "Sure."
    assert body["message"]["reasoning_content"].strip() == "Let me look it up."
    assert [orjson.loads(c["function"]["arguments"]) for c in body["message"]["tool_calls"]] == [{"city": "Oslo"}]


def test_a_tool_call_cut_by_max_tokens_finishes_with_length() -> None:
    parsers = ParserSettings(tool_parser="qwen3")
    cut = ['<tool_call>\n{"name": "get_weather", "arguments": {"ci']
    assert (
        complete(responder(parsers, tools=TOOLS), outputs(cut, finish="length"))["choices"][0]["finish_reason"]
        == "length"
    )


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_an_unclosed_tool_call_is_content_not_an_invented_call(finish: str) -> None:
    parsers = ParserSettings(tool_parser="qwen3")
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    choice = complete(responder(parsers, tools=TOOLS), outputs([text[:20], text[20:]], finish=finish))["choices"][0]
    assert choice["finish_reason"] == finish
    assert choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]


def test_tool_choice_none_or_no_tools_leaves_tool_text_as_content() -> None:
    parsers = ParserSettings(tool_parser="qwen3")
    text = ['<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>']
    for body in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        choice = complete(responder(parsers, **body), outputs(text))["choices"][0]
        assert choice["message"]["content"] == text[0] and choice["finish_reason"] == "stop"


def test_n_choices_are_interleaved_by_index() -> None:
    async def interleaved() -> AsyncIterator[RequestOutput]:
        for i, (index, text) in enumerate([(0, "a"), (1, "x"), (0, "b"), (1, "y")]):
            yield RequestOutput("r", index, (i,), text, "stop" if i >= 2 else None, 3, 1 + i // 2)

    body = complete(responder(n=2), interleaved())
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "xy"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
