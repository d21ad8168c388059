"""OpenAI requests: the typed models of api/models.py (field types and ranges) become frozen
`ChatRequest` / `CompletionRequest` with `SamplingParams`, within the server's `RequestLimits`;
/tokenize and /detokenize bodies (vLLM's shapes) become `TokenizeRequest` / `DetokenizeRequest`.
Every user mistake is an `APIError` (400) naming the parameter; unknown fields are ignored. Token
ids against the model's vocabulary and the context length are the engine's input processor's to
check (engine/input_processor.py), the one place that knows the model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from api.errors import bad_request
from api.limits import RequestLimits
from api.messages import parse_messages, parse_tool_choice, parse_tools
from api.models import (
    ChatCompletionRequest,
    CompletionRequestModel,
    DetokenizeRequestModel,
    SamplingRequest,
    StreamOptionsModel,
    TokenizeRequestModel,
    validate,
)
from api.response_format import ResponseFormat, parse_response_format, refuse_with_tool_choice
from scheduler.request import ParamError, SamplingParams

DEFAULT_LIMITS = RequestLimits()
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Arguments the server itself passes to the template (or that would swap the template out).
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "add_generation_prompt", "tokenize", "chat_template"})


@dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False  # a last chunk with `choices: []` and the usage


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]  # normalised for the chat template (see api/messages.py)
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    template_kwargs: dict[str, Any]  # chat_template_kwargs plus a top-level enable_thinking
    add_generation_prompt: bool
    params: SamplingParams  # max_tokens is the requested value; see resolve_max_tokens
    max_tokens: int | None
    top_logprobs: int | None  # None: no logprobs; else how many alternatives per token
    stream: StreamOptions
    return_token_ids: bool
    response_format: ResponseFormat | None = None  # None: free text


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # each prompt gets its own `n` choices
    params: SamplingParams
    max_tokens: int | None
    logprobs: int | None
    stream: StreamOptions
    return_token_ids: bool
    response_format: ResponseFormat | None = None
    echo: bool = False  # the prompt text (and, with logprobs, its tokens' logprobs) comes first
    prompt_logprobs: int | None = None  # vLLM's: each choice's `prompt_logprobs`, with this many top
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt alone (one token runs, unshown)


@dataclass(frozen=True)
class TokenizeRequest:
    """A prompt as it is, or chat messages through the chat template as /v1/chat/completions
    renders them (exactly one of `prompt` and `messages`)."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]
    add_special_tokens: bool  # the tokenizer's own BOS/EOS; a chat template writes its own
    return_token_strs: bool

    def __post_init__(self) -> None:
        assert (self.prompt is None) != (self.messages is None), "a prompt or messages, not both"


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    token_ids: list[int]


def parse_chat_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    m: ChatCompletionRequest = validate(ChatCompletionRequest, body, limits)
    tools = parse_tools(m.tools)
    tool_choice = parse_tool_choice(m.tool_choice, tools)
    response_format = parse_response_format(m.response_format)
    refuse_with_tool_choice(response_format, tool_choice)
    top_logprobs = m.top_logprobs
    if top_logprobs is not None and not m.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    wanted = (top_logprobs or 0) if m.logprobs else None
    max_tokens = m.max_completion_tokens or m.max_tokens
    return ChatRequest(
        model=m.model,
        messages=parse_messages(m.messages),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_default(m.parallel_tool_calls, True),
        template_kwargs=_template_kwargs(m.chat_template_kwargs, m.enable_thinking),
        add_generation_prompt=_default(m.add_generation_prompt, True),
        params=_sampling_params(m, max_tokens, wanted),
        max_tokens=max_tokens,
        top_logprobs=wanted,
        stream=_stream_options(m.stream, m.stream_options),
        return_token_ids=_default(m.return_token_ids, False),
        response_format=response_format,
    )


def parse_completion_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    m: CompletionRequestModel = validate(CompletionRequestModel, body, limits)
    if m.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    response_format = parse_response_format(m.response_format)
    logprobs = m.logprobs
    prompt_logprobs = m.prompt_logprobs
    echo = _default(m.echo, False)
    # vLLM's echo semantics: max_tokens 0 returns the prompt alone (one token runs, unshown).
    prompt_only = m.max_tokens == 0
    if prompt_only and not echo:
        raise bad_request("max_tokens must be at least 1, got 0 (0 is taken with echo only)", "max_tokens")
    max_tokens = 1 if prompt_only else m.max_tokens
    # The engine scores the prompt for `prompt_logprobs`, and for echo with logprobs.
    scored = [k for k in (logprobs if echo else None, prompt_logprobs) if k is not None]
    params = _sampling_params(m, max_tokens, logprobs)
    return CompletionRequest(
        model=m.model,
        prompts=parse_prompts(m.prompt),
        params=replace(params, prompt_logprobs=max(scored)) if scored else params,
        max_tokens=max_tokens,
        logprobs=logprobs,
        stream=_stream_options(m.stream, m.stream_options),
        return_token_ids=_default(m.return_token_ids, False),
        response_format=response_format,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        prompt_only=prompt_only,
    )


def parse_tokenize_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> TokenizeRequest:
    if body.get("prompt") is None and body.get("messages") is None:
        raise bad_request("send a prompt (a string) or messages (a chat) to tokenize", "messages")
    if body.get("prompt") is not None and body.get("messages") is not None:
        raise bad_request("send a prompt or messages, not both", "prompt")
    m: TokenizeRequestModel = validate(TokenizeRequestModel, body, limits)
    chat = m.messages is not None
    return TokenizeRequest(
        model=m.model,
        prompt=m.prompt,
        messages=parse_messages(m.messages) if chat else None,
        tools=parse_tools(m.tools) if chat else None,
        add_generation_prompt=_default(m.add_generation_prompt, True),
        template_kwargs=_template_kwargs(m.chat_template_kwargs, m.enable_thinking),
        # vLLM's defaults: a prompt gets the tokenizer's special tokens, a rendered chat does not.
        add_special_tokens=_default(m.add_special_tokens, not chat),
        return_token_strs=_default(m.return_token_strs, False),
    )


def parse_detokenize_request(body: dict[str, Any], vocab_size: int) -> DetokenizeRequest:
    """NOTE: /detokenize never reaches the engine, so its ids are checked against the vocabulary here."""
    m: DetokenizeRequestModel = validate(DetokenizeRequestModel, body)
    if m.tokens is None:
        raise bad_request("tokens must be a list of token ids", "tokens")
    bad = next((x for x in m.tokens if not 0 <= x < vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens has token id {bad}, outside the vocabulary [0, {vocab_size})", "tokens")
    return DetokenizeRequest(model=m.model, token_ids=list(m.tokens))


def parse_prompts(raw: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of those (ids are checked
    against the vocabulary by the engine's input processor)."""
    if isinstance(raw, str):
        return [_nonempty_text(raw, "prompt")]
    if not isinstance(raw, list) or not raw:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of those", "prompt")
    if all(_is_int(x) for x in raw):
        return [list(raw)]
    prompts: list[str | list[int]] = []
    for i, item in enumerate(raw):
        param = f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(_nonempty_text(item, param))
        elif isinstance(item, list) and item and all(_is_int(x) for x in item):
            prompts.append(list(item))
        else:
            raise bad_request(f"{param} must be a non-empty string or a non-empty list of token ids", param)
    return prompts


def resolve_max_tokens(
    params: SamplingParams,
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_param: str,
    cap: int | None = None,
) -> SamplingParams:
    """The request's parameters with max_tokens fixed: absent means the rest of the context, or
    `cap` (--max-output-tokens) if that is less."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (at least one token must be left to generate)",
            prompt_param,
            CONTEXT_LENGTH_EXCEEDED,
        )
    room = max_model_len - num_prompt_tokens
    if requested is not None and requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and max_tokens asks for {requested} more",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if requested is None:
        requested = room if cap is None else min(room, cap)
    return replace(params, max_tokens=requested)


def _sampling_params(
    m: SamplingRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    min_tokens = m.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    stop = (m.stop,) if isinstance(m.stop, str) else tuple(m.stop or ())
    stop_token_ids = tuple(m.stop_token_ids or ())
    try:
        return SamplingParams(
            n=m.n or 1,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=_default(m.temperature, 1.0),
            top_p=_default(m.top_p, 1.0),
            top_k=m.top_k or 0,
            min_p=_default(m.min_p, 0.0),
            presence_penalty=_default(m.presence_penalty, 0.0),
            frequency_penalty=_default(m.frequency_penalty, 0.0),
            repetition_penalty=_default(m.repetition_penalty, 1.0),
            logit_bias=tuple(sorted((m.logit_bias or {}).items())),
            seed=m.seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=_default(m.ignore_eos, False),
            logprobs=logprobs,
            skip_special_tokens=_default(m.skip_special_tokens, True),
            include_stop_str_in_output=_default(m.include_stop_str_in_output, False),
            speculative=_default(m.speculative_decoding, True),
        )
    except ParamError as e:
        raise bad_request(e.message, e.param) from None


def _template_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """chat_template_kwargs, plus a top-level enable_thinking (which they override)."""
    template_kwargs = dict(kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if enable_thinking is not None:
        template_kwargs = {"enable_thinking": enable_thinking, **template_kwargs}
    return template_kwargs


def _stream_options(stream: bool | None, options: StreamOptionsModel | None) -> StreamOptions:
    streaming = bool(stream)
    return StreamOptions(stream=streaming, include_usage=streaming and bool(options and options.include_usage))


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _nonempty_text(text: str, param: str) -> str:
    if not text:
        raise bad_request(f"{param} must not be empty", param)
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
