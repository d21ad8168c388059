"""OpenAI request parsing: JSON bodies of /v1/chat/completions and /v1/completions become
frozen `ChatRequest` / `CompletionRequest` with validated `SamplingParams`, within the server's
`RequestLimits`; those of /tokenize and /detokenize (vLLM's shapes) become `TokenizeRequest` /
`DetokenizeRequest`. Every user mistake is an `APIError` (400) naming the parameter; unknown
fields are ignored."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from api.errors import bad_request
from api.limits import RequestLimits, check_max_tokens, check_stop, too_many
from api.messages import parse_messages, parse_tool_choice, parse_tools
from api.response_format import ResponseFormat, parse_response_format, refuse_with_tool_choice
from scheduler.request import ParamError, SamplingParams

DEFAULT_LIMITS = RequestLimits()
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_INT64 = (-(1 << 63), (1 << 63) - 1)
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


def parse_chat_request(body: dict[str, Any], vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    tools = _tools(body, limits)
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    response_format = parse_response_format(body.get("response_format"))
    refuse_with_tool_choice(response_format, tool_choice)
    logprobs = _optional(body, "logprobs", bool) or False
    top_logprobs = _capped(body, "top_logprobs", 0, limits.max_logprobs, "--max-logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    wanted = (top_logprobs or 0) if logprobs else None
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    check_max_tokens(max_tokens, limits, max_tokens_param)
    return ChatRequest(
        model=_optional(body, "model", str),
        messages=parse_messages(body.get("messages")),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        template_kwargs=_template_kwargs(body),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        params=_sampling_params(body, vocab_size, max_tokens, wanted, limits),
        max_tokens=max_tokens,
        top_logprobs=wanted,
        stream=_stream_options(body),
        return_token_ids=_bool(body, "return_token_ids", False),
        response_format=response_format,
    )


def parse_completion_request(
    body: dict[str, Any], vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS
) -> CompletionRequest:
    if body.get("suffix"):
        raise bad_request("suffix is not supported by this server", "suffix")
    response_format = parse_response_format(body.get("response_format"))
    logprobs = _capped(body, "logprobs", 0, limits.max_logprobs, "--max-logprobs")
    echo = _bool(body, "echo", False)
    prompt_logprobs = _capped(body, "prompt_logprobs", 0, limits.max_logprobs, "--max-logprobs")
    # vLLM's echo semantics: max_tokens 0 returns the prompt alone.
    prompt_only = echo and _int_in(body, "max_tokens", 0, None) == 0
    max_tokens = 1 if prompt_only else _max_tokens(body, "max_tokens")
    check_max_tokens(max_tokens, limits, "max_tokens")
    scored = [n for n in (logprobs if echo else None, prompt_logprobs) if n is not None]
    params = _sampling_params(body, vocab_size, max_tokens, logprobs, limits)
    return CompletionRequest(
        model=_optional(body, "model", str),
        prompts=parse_prompts(body.get("prompt"), vocab_size),
        params=replace(params, prompt_logprobs=max(scored)) if scored else params,
        max_tokens=max_tokens,
        logprobs=logprobs,
        stream=_stream_options(body),
        return_token_ids=_bool(body, "return_token_ids", False),
        response_format=response_format,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        prompt_only=prompt_only,
    )


def parse_tokenize_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> TokenizeRequest:
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is None and messages is None:
        raise bad_request("send a prompt (a string) or messages (a chat) to tokenize", "messages")
    if prompt is not None and messages is not None:
        raise bad_request("send a prompt or messages, not both", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request(f"prompt must be a string, got {_json_type(prompt)}", "prompt")
    return TokenizeRequest(
        model=_optional(body, "model", str),
        prompt=prompt,
        messages=None if messages is None else parse_messages(messages),
        tools=None if messages is None else _tools(body, limits),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        template_kwargs=_template_kwargs(body),
        # vLLM's defaults: a prompt gets the tokenizer's special tokens, a rendered chat does not.
        add_special_tokens=_bool(body, "add_special_tokens", messages is None),
        return_token_strs=_bool(body, "return_token_strs", False),
    )


def parse_detokenize_request(body: dict[str, Any], vocab_size: int) -> DetokenizeRequest:
    return DetokenizeRequest(
        model=_optional(body, "model", str),
        token_ids=_token_ids(body.get("tokens"), vocab_size, "tokens", allow_empty=True),
    )


def parse_prompts(raw: Any, vocab_size: int) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(raw, str):
        return [_nonempty_text(raw, "prompt")]
    if not isinstance(raw, list) or not raw:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of those", "prompt")
    if all(_is_int(x) for x in raw):
        return [_token_ids(raw, vocab_size, "prompt")]
    prompts: list[str | list[int]] = []
    for i, item in enumerate(raw):
        param = f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(_nonempty_text(item, param))
        elif isinstance(item, list) and item and all(_is_int(x) for x in item):
            prompts.append(_token_ids(item, vocab_size, param))
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
    body: dict[str, Any], vocab_size: int, max_tokens: int | None, logprobs: int | None, limits: RequestLimits
) -> SamplingParams:
    min_tokens = _int_in(body, "min_tokens", 0, None) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    seed = _int_in(body, "seed", *_INT64)
    stop = _stop(body.get("stop"))
    stop_token_ids = _token_ids(body.get("stop_token_ids") or [], vocab_size, "stop_token_ids", allow_empty=True)
    check_stop(stop, stop_token_ids, limits)
    try:
        return SamplingParams(
            n=_capped(body, "n", 1, limits.max_n, "--max-n") or 1,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_int_in(body, "top_k", -1, None) or 0,
            min_p=_number(body, "min_p", 0.0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        )
    except ParamError as e:
        raise bad_request(e.message, e.param) from None


def _tools(body: dict[str, Any], limits: RequestLimits) -> list[dict[str, Any]] | None:
    tools = parse_tools(body.get("tools"))
    if tools and len(tools) > limits.max_tools:
        raise too_many("tools", len(tools), limits.max_tools, "--max-tools")
    return tools


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs, plus a top-level enable_thinking (which they override)."""
    template_kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    enable_thinking = _optional(body, "enable_thinking", bool)
    if enable_thinking is not None:
        template_kwargs = {"enable_thinking": enable_thinking, **template_kwargs}
    return template_kwargs


def _stream_options(body: dict[str, Any]) -> StreamOptions:
    stream = _bool(body, "stream", False)
    options = _optional(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return StreamOptions(stream=stream, include_usage=stream and bool(include_usage))


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    return _int_in(body, name, 1, None)


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise bad_request("stop must be a string or a list of strings", "stop")


def _logit_bias(raw: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not _is_number(value):
            raise bad_request(f"logit_bias value for {key!r} must be a number", "logit_bias")
        out[token_id] = float(value)
    return tuple(sorted(out.items()))


def _token_ids(raw: Any, vocab_size: int, param: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(raw, list) or not all(_is_int(x) for x in raw) or (not raw and not allow_empty):
        raise bad_request(f"{param} must be a {'' if allow_empty else 'non-empty '}list of token ids", param)
    bad = next((x for x in raw if not 0 <= x < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} has token id {bad}, outside the vocabulary [0, {vocab_size})", param)
    return list(raw)


def _nonempty_text(text: str, param: str) -> str:
    if not text:
        raise bad_request(f"{param} must not be empty", param)
    return text


# Typed field readers: JSON null counts as absent (clients send it for "not given").


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad_request(f"{name} must be {_KIND_NAMES[kind]}, got {_json_type(value)}", name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = _optional(body, name, bool)
    return default if value is None else value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(f"{name} must be a number, got {_json_type(value)}", name)
    return float(value)


def _int_in(body: dict[str, Any], name: str, low: int | None, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some clients serialise every number as a float
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer, got {_json_type(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_request(f"{name} must be {bounds}, got {value}", name)
    return value


def _capped(body: dict[str, Any], name: str, low: int, cap: int, flag: str) -> int | None:
    """An integer at least `low` and at most the server's `cap` (set by `flag`)."""
    value = _int_in(body, name, low, None)
    if value is not None and value > cap:
        raise bad_request(f"{name} must be between {low} and {cap} on this server ({flag}), got {value}", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


_KIND_NAMES = {str: "a string", bool: "a boolean", dict: "an object", list: "an array"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return f"number {value}"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)

