"""The one chat pipeline every protocol maps into:

    the protocol's route: its request model (validated once) -> its mapping -> ChatCompletionRequest
      -> start_chat: the model name, the early admission check, the chat template, the grammar
         (response_format, or a forced tool call), the engine request, which the engine validates
         (max_tokens, context length, ids) and admits; the first output is awaited before the
         response starts, so a refusal is an HTTP error in the protocol's shape
      -> Choices: each engine output through its choice's output parser (tool calls, reasoning)
      -> the protocol's Encoder: its events (streamed) or its body
      -> respond: one SSE tail that owns cancellation, the in-band error event and the end of
         the stream; or one JSON body, abandoned (and the request aborted) if the client leaves.

/v1/completions enters through `start_completion` (text or token-id prompts, several merged into
one stream) and shares the rest. Between the engine and the socket there are three async layers:
AsyncEngine's per-request stream (pumped into `EngineStream`, which merges prompts and keeps the
deadline), the event generator (`stream_events`), and SSEResponse.

Adding an API is a mapping, not a pipeline: write its request model with a `to_chat_request()`
(api/responses/request.py, api/anthropic/request.py), and an `Encoder` for its events and body
(api/responses/output.py, api/anthropic/routes.py); its route is then read, validate, map,
`start_chat`, `respond`. Nothing here changes."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from api.access.keys import request_owner
from api.context_errors import COMPLETIONS, Dialect, refusals
from api.engine_stream import EngineStream
from api.errors import APIError, bad_request
from api.grammars.response_format import response_format_spec
from api.grammars.tool_grammar import tool_call_spec
from api.http import json_response, server_state, unless_disconnected
from api.parsers import OutputParser, ParsedDelta, ParserSettings
from api.parsers.base import coalesce_tool_deltas
from api.request.models import ChatCompletionRequest, CompletionRequestModel
from api.transport.deadline import Deadline
from api.transport.inflight import request_deadline
from api.transport.sse import SSEResponse
from engine.front import Owner, Reasoning, RequestOutput, SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from api.state import ServerState
    from engine.front import AsyncEngine

logger = logging.getLogger("fp4serve.api")

# Sent with a chat request's tools when the chat template never shows them to the model.
WARNING_HEADER = "x-fp4serve-warning"
TOOLS_IGNORED = "the chat template ignores tools: the model never saw them"


@dataclass(frozen=True)
class ResponseHeader:
    """What every chunk and body of one response repeats: the same id and created time."""

    id: str
    created: int
    model: str

    @staticmethod
    def new(prefix: str, model: str) -> ResponseHeader:
        return ResponseHeader(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass(frozen=True)
class ChoiceDelta:
    """What one engine output means for one choice."""

    index: int  # the choice (completions: prompt index * n + sample index)
    prompt_index: int
    out: RequestOutput  # ids, logprobs and counts as the engine sent them
    parsed: ParsedDelta  # the text through the choice's parser (on the last output, what it held back too)
    finish_reason: str | None  # on the last output: the engine's, as the parser resolves it (tool_calls)
    broken_calls: tuple[int, ...] = ()  # the parser's calls whose text never closed, so far


class Choices:
    """Each choice's output parser (None: plain text); turns an engine output into a ChoiceDelta."""

    def __init__(self, n: int, parsers: list[OutputParser | None]) -> None:
        self.n = n  # samples per prompt
        self.parsers = parsers  # one per choice

    def __len__(self) -> int:
        return len(self.parsers)

    def parses(self, index: int) -> bool:
        return self.parsers[index] is not None

    def step(self, prompt_index: int, out: RequestOutput) -> ChoiceDelta:
        index = prompt_index * self.n + out.index
        parser = self.parsers[index]
        if parser is None:
            return ChoiceDelta(index, prompt_index, out, ParsedDelta(content=out.text_delta), out.finish_reason)
        parsed = parser.feed(out.text_delta)
        reason = None
        if out.finish_reason is not None:
            tail = parser.finish()
            # One delta per chunk; one entry per tool-call index (older SDKs keep duplicates).
            parsed = ParsedDelta(
                parsed.content + tail.content,
                parsed.reasoning + tail.reasoning,
                coalesce_tool_deltas([*parsed.tool_calls, *tail.tool_calls]),
            )
            reason = parser.finish_reason(out.finish_reason)
        return ChoiceDelta(index, prompt_index, out, parsed, reason, parser.broken_calls)


@dataclass
class Totals:
    """What one choice's outputs said in the end (the agent protocols' usage and stop fields)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None  # resolved: stop | length | tool_calls | abort (None: not ended)
    stop_reason: int | str | None = None  # the stop string or token that ended it, if any

    def add(self, delta: ChoiceDelta) -> None:
        out = delta.out
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        self.output_tokens = out.num_output_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, out.stop_reason

    @property
    def ended_as(self) -> str:
        return self.finish_reason or "abort"


@dataclass(frozen=True)
class Started:
    """A request in the engine with its first output in hand: what an Encoder is built from."""

    header: ResponseHeader
    prompts: list[list[int]]  # each prompt's token ids
    opens_reasoning: bool  # the template left a <think> block open: the output starts as reasoning
    stream: EngineStream
    choices: Choices
    streaming: bool
    headers: tuple[tuple[str, str], ...] = ()  # extra response headers (a warning)


class Encoder(Protocol):
    """One protocol's shapes for one response. Streamed: start, then add per output, then end (or
    error, in its place), then done. Not streamed: add per output, then body."""

    def start(self) -> list[bytes]: ...

    def add(self, delta: ChoiceDelta) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...

    def error(self, error: APIError) -> list[bytes]: ...

    def done(self) -> list[bytes]: ...

    def body(self) -> dict[str, Any]: ...


# ---- starting a request ------------------------------------------------------------------------------
def check_model(requested: str | None, engine: AsyncEngine) -> None:
    if requested is not None and requested != engine.info.model_name:
        raise APIError(
            404,
            f"model {requested!r} does not exist; this server serves {engine.info.model_name!r}",
            "model",
            "model_not_found",
        )


async def render_chat(state: ServerState, engine: AsyncEngine, chat: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids from the checkpoint's chat template, off the event loop."""
    return await state.run_blocking(
        engine.input_processor.render_chat,
        chat.messages,
        chat.tools,
        chat.add_generation_prompt is not False,
        chat.template_kwargs,
    )


async def start_chat(request: Request, chat: ChatCompletionRequest, id_prefix: str, dialect: Dialect) -> Started:
    """A chat request into the engine. `dialect`: how the API names the prompt and max_tokens,
    and whose words its refusals use (api/context_errors.py)."""
    state = server_state(request)
    engine = state.ready_engine()
    check_model(chat.model, engine)
    # The body's own mistakes come before the template runs.
    params = chat.to_sampling_params(engine.info.sampling_defaults)
    headers = _tools_ignored(request, chat, engine)
    with refusals(dialect):
        with engine.admission.preparing():
            prompt = await render_chat(state, engine, chat)
        tail = engine.input_processor.prompt_tail(prompt) if state.parsers.reasoning_parser is not None else ""
        opens_reasoning = prompt_opens_reasoning(tail)
        params = replace(params, structured=_structured(chat, state.parsers, tail, opens_reasoning))
        header = ResponseHeader.new(id_prefix, engine.info.model_name)
        owner = request_owner(request.scope, chat.priority)
        stream = await start_stream(
            engine, [prompt], params, header.id, owner, request.receive, request_deadline(request.scope)
        )
    forced = params.structured is not None and params.structured.kind == "tool_calls"
    parsers = [
        state.parsers.make(
            chat.tools, chat.tool_choice, chat.calls_in_parallel, opens_reasoning, chat.streaming, forced
        )
        for _ in range(params.n)
    ]
    return Started(header, [prompt], opens_reasoning, stream, Choices(params.n, parsers), chat.streaming, headers)


async def start_completion(request: Request, req: CompletionRequestModel) -> Started:
    """Completion prompts (text or token ids) into the engine, each with its own n samples. Every
    check a prompt's size allows runs before any prompt is tokenized, and tokenizing stops at the
    first prompt that cannot fit."""
    state = server_state(request)
    engine = state.ready_engine()
    if len(req.prompt) > state.config.max_prompts:
        raise bad_request(
            f"{len(req.prompt)} prompts in one request; the limit is {state.config.max_prompts} (--max-prompts)",
            "prompt",
        )
    check_model(req.model, engine)
    params = req.to_sampling_params(engine.info.sampling_defaults)
    inputs = engine.input_processor
    with refusals(COMPLETIONS):
        for sent in req.prompt:
            if isinstance(sent, list):
                inputs.check_prompt_ids(len(sent))
            else:
                inputs.check_prompt_chars(len(sent))
        prompts: list[list[int]] = []
        with engine.admission.preparing():
            for sent in req.prompt:
                prompts.append(sent if isinstance(sent, list) else await state.run_blocking(inputs.encode, sent))
                inputs.check_prompt_ids(len(prompts[-1]))
        if req.response_format is not None:
            params = replace(params, structured=response_format_spec(req.response_format))
        header = ResponseHeader.new("cmpl", engine.info.model_name)
        stream = await start_stream(
            engine,
            prompts,
            params,
            header.id,
            request_owner(request.scope, req.priority),
            request.receive,
            request_deadline(request.scope),
        )
    return Started(header, prompts, False, stream, Choices(params.n, [None] * (len(prompts) * params.n)), req.streaming)


def _tools_ignored(request: Request, chat: ChatCompletionRequest, engine: AsyncEngine) -> tuple[tuple[str, str], ...]:
    """A response header and a WARNING line when the request's tools never reach the model."""
    if not chat.tools or engine.input_processor.renders_tools:
        return ()
    logger.warning(
        "%s %s: %d tools sent, but the chat template of %s does not render tools: the model never sees "
        "them and answers as plain chat",
        request.method,
        request.url.path,
        len(chat.tools),
        engine.info.model_name,
    )
    return ((WARNING_HEADER, TOOLS_IGNORED),)


async def start_stream(
    engine: AsyncEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    owner: Owner,
    receive: Receive,
    deadline: Deadline | None,
) -> EngineStream:
    """Every prompt validated by the engine before any runs, then the first output awaited (a
    client that leaves meanwhile is aborted: ClientDisconnected)."""
    if deadline is not None:
        deadline.check()  # e.g. it passed while the prompt waited for the tokenizer
    sources: list[AsyncIterator[RequestOutput]] = []
    try:
        for i, prompt in enumerate(prompts):
            sources.append(
                engine.generate(prompt, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", owner)
            )
    except BaseException:
        for source in sources:  # not started: nothing entered the engine
            await source.aclose()  # type: ignore[attr-defined]
        raise
    stream = EngineStream(sources, deadline)
    try:
        await unless_disconnected(stream.first(), receive)
    except BaseException:
        await stream.aclose()
        raise
    return stream


def _structured(
    chat: ChatCompletionRequest, parsers: ParserSettings, prompt_tail: str, opens_reasoning: bool
) -> StructuredOutput | None:
    """What response_format, or tool_choice "required" or a named function, makes the output be
    (the request model refuses both at once); None when the output is free."""
    if chat.response_format is None and not chat.forces_tool_call:
        return None
    # A think block may come first unless the prompt closed it (enable_thinking=false).
    reasoning = Reasoning.NONE
    if parsers.reasoning_parser is not None and not prompt_closes_reasoning(prompt_tail):
        reasoning = Reasoning.OPEN if opens_reasoning else Reasoning.OPTIONAL
    if chat.response_format is not None:
        return response_format_spec(chat.response_format, reasoning)
    if parsers.tool_parser is None:
        raise bad_request(
            "tool_choice 'required' or a named function needs the server to run with --tool-parser", "tool_choice"
        )
    return tool_call_spec(
        chat.tools, chat.tool_choice, parsers.tool_parser, reasoning, parallel_tool_calls=chat.calls_in_parallel
    )


def prompt_closes_reasoning(prompt_tail: str) -> bool:
    """Whether the template already wrote a closed think block (enable_thinking=false): the
    output has none. `prompt_tail`: the prompt's last tokens as text (InputProcessor.prompt_tail)."""
    return prompt_tail.rstrip().endswith("</think>")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the template left a `<think>` block open, so the output starts as reasoning."""
    return prompt_tail.rstrip().endswith("<think>")


# ---- answering ---------------------------------------------------------------------------------------
async def respond(request: Request, started: Started, encoder: Encoder) -> Response:
    """The response: the encoder's events as SSE, or its body as JSON."""
    if started.streaming:
        return SSEResponse(stream_events(started, encoder), dict(started.headers))
    response = json_response(await unless_disconnected(collect_body(started, encoder), request.receive))
    response.headers.update(dict(started.headers))
    return response


async def stream_events(started: Started, encoder: Encoder) -> AsyncIterator[bytes]:
    """The one stream tail. The 200 is sent by now, so an error goes in-band, in the protocol's
    shape (an unexpected one with its trace to the log only); the client leaving cancels the
    stream, and SSEResponse closes this generator, which aborts the request."""
    stream = started.stream
    try:
        for event in encoder.start():
            yield event
        while (item := await stream.next()) is not None:
            for event in encoder.add(started.choices.step(*item)):
                yield event
        for event in encoder.end():
            yield event
    except asyncio.CancelledError:
        raise
    except APIError as e:  # the engine failed the request, or its deadline passed (timeout, shutdown)
        for event in encoder.error(e):
            yield event
    except Exception:
        logger.exception("stream %s failed", started.header.id)
        for event in encoder.error(APIError(500, "generation failed; see the server log")):
            yield event
    finally:
        await stream.aclose()
    for event in encoder.done():
        yield event


async def collect_body(started: Started, encoder: Encoder) -> dict[str, Any]:
    """The encoder's body once every output is in; the engine's error as an HTTP error."""
    try:
        while (item := await started.stream.next()) is not None:
            encoder.add(started.choices.step(*item))
    finally:
        await started.stream.aclose()
    return encoder.body()
