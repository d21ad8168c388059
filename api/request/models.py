"""The OpenAI protocol's request models (pydantic v2) for chat and completions: each
field's JSON type and OpenAI's documented range is declared once here, and the nested shapes with
their own parameter paths (messages, tools, tool_choice, response_format, prompt) are normalised by
the models' own validators (api/request/messages.py, api/grammars/response_format.py). So a validated model is the
request the pipeline runs (api/pipeline.py), and `to_sampling_params()` gives its sampling
parameters; no second copy of it exists. /v1/responses and /v1/messages map their own models onto
`ChatCompletionRequest` (`ChatCompletionRequest.mapped`); /tokenize's are in api/openai/tokenize.py."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from api.errors import bad_request
from api.grammars.response_format import ResponseFormat, parse_response_format, refuse_with_tool_choice
from api.grammars.vllm_fields import parse_vllm_fields
from api.request.messages import parse_messages, parse_tool_choice, parse_tools
from api.request.validation import (
    Bool,
    Int,
    Number,
    RequestModel,
    ToolsRequest,
    at_most,
    check_depth,
    integral,
    limits_of,
    stop_limit,
    too_many,
)
from engine.front import SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# What an absent sampling field means when the checkpoint sets no default for it (OpenAI's and
# vLLM's values); engine/weights/config/generation_config.py's defaults override these.
SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# Arguments the server itself passes to the template (or that would swap the template out).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "add_generation_prompt", "tokenize", "chat_template"}
)


def _stop(value: Any) -> Any:
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    raise ValueError("stop must be a string or a list of strings")


def _logit_bias(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias value for {key!r} must be a number")
        if not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        out[token_id] = float(bias)
    return out


def token_id_list(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError("must be a list of token ids")
    return value


def template_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """chat_template_kwargs, plus a top-level enable_thinking (which they override)."""
    merged = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(merged))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if enable_thinking is not None:
        merged = {"enable_thinking": enable_thinking, **merged}
    return merged


class StreamOptionsModel(RequestModel):
    include_usage: Bool | None = None


class SamplingRequest(RequestModel):
    """The fields chat and completions share: how to sample and when to stop (OpenAI's ranges;
    top_k, min_p, repetition_penalty and the rest as vLLM accepts them)."""

    n: Int | None = Field(None, ge=1)
    max_tokens: Int | None = Field(None, ge=1)
    min_tokens: Int | None = Field(None, ge=0)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=2.0)
    logit_bias: Annotated[Any, AfterValidator(_logit_bias)] = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Annotated[Any, AfterValidator(_stop)] = None
    stop_token_ids: Annotated[Any, AfterValidator(token_id_list)] = None
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    stream: Bool | None = None
    stream_options: StreamOptionsModel | None = None
    return_token_ids: Bool | None = None
    response_format: Any = None  # api/grammars/response_format.py: a ResponseFormat (or None) once validated
    # vLLM's structured-output fields (api/grammars/vllm_fields.py): folded into response_format.
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    priority: Int | None = Field(None, ge=-(1 << 31), le=(1 << 31) - 1)  # vLLM's: lower is served first
    speculative_decoding: Bool | None = None  # false: this request never drafts (extra body field)

    def output_format(self) -> ResponseFormat | None:
        """response_format, or what vLLM's structured_outputs / guided_* ask for (not both)."""
        response_format = parse_response_format(self.response_format)
        vllm = parse_vllm_fields(
            self.structured_outputs,
            {
                "guided_json": self.guided_json,
                "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar,
            },
        )
        if response_format is not None and vllm is not None:
            raise bad_request(
                "response_format cannot be combined with structured_outputs or guided_*; use one", "response_format"
            )
        return response_format or vllm

    # ---- the server's limits, as validators ----------------------------------------------------
    @field_validator("n")
    @classmethod
    def _n_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return at_most(value, "n", 1, limits_of(info).max_n, "--max-n")

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: Any, info: ValidationInfo) -> Any:
        return stop_limit(value, "stop", info)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_limit(cls, value: Any, info: ValidationInfo) -> Any:
        limits = limits_of(info)
        if value is not None and len(value) > limits.max_stop:
            raise too_many("stop_token_ids", len(value), limits.max_stop, "--max-stop")
        return value

    # ---- what the pipeline reads -----------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """A last chunk with `choices: []` and the usage (streaming only)."""
        return self.streaming and bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: Iterable[tuple[str, float]] = ()
    ) -> SamplingParams:
        """`max_tokens` None: absent (the input processor resolves it against the prompt, and caps
        it by --max-output-tokens). `defaults`: the checkpoint's generation_config.json values
        (engine/weights/config/generation_config.py) for the sampling fields the request leaves out. ParamError (a
        400 naming the field) for what SamplingParams refuses."""
        fallback = {**SAMPLING_DEFAULTS, **dict(defaults)}
        min_tokens = self.min_tokens or 0
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        return SamplingParams(
            n=self.n or 1,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=_default(self.temperature, fallback["temperature"]),
            top_p=_default(self.top_p, fallback["top_p"]),
            top_k=int(_default(self.top_k, fallback["top_k"])),
            min_p=_default(self.min_p, fallback["min_p"]),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, fallback["repetition_penalty"]),
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=_default(self.ignore_eos, False),
            logprobs=logprobs,
            skip_special_tokens=_default(self.skip_special_tokens, True),
            include_stop_str_in_output=_default(self.include_stop_str_in_output, False),
            speculative=_default(self.speculative_decoding, True),
        )


class ChatCompletionRequest(SamplingRequest, ToolsRequest):
    """Once validated: `messages` normalised for the chat template (api/request/messages.py), `tools` in
    chat's nested shape, `tool_choice` checked against them, `response_format` a ResponseFormat."""

    messages: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: Bool | None = None
    add_generation_prompt: Bool | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0)
    max_completion_tokens: Int | None = Field(None, ge=1)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return at_most(value, "top_logprobs", 0, limits_of(info).max_logprobs, "--max-logprobs")

    @model_validator(mode="after")
    def _normalised(self) -> ChatCompletionRequest:
        """The nested shapes and the rules across fields, once every field has its type."""
        tools = parse_tools(self.tools)
        tool_choice = parse_tool_choice(self.tool_choice, tools)
        response_format = self.output_format()
        refuse_with_tool_choice(response_format, tool_choice)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        messages = parse_messages(self.messages)
        template_kwargs(self.chat_template_kwargs, self.enable_thinking)
        check_depth(self.chat_template_kwargs, "chat_template_kwargs")
        return self.model_copy(
            update={
                "messages": messages,
                "tools": tools,
                "tool_choice": tool_choice,
                "response_format": response_format,
            }
        )

    @classmethod
    def mapped(cls, **fields: Any) -> ChatCompletionRequest:
        """The chat request another protocol's request means (api/responses/request.py,
        api/anthropic/request.py), built from values that protocol's model has already checked,
        in the normalised shapes (messages, tools, tool_choice, a ResponseFormat): not validated
        again."""
        return cls.model_construct(**fields)

    @property
    def max_tokens_requested(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with enable_thinking; a forced tool call turns thinking off unless the
        request set it: the call must come within a small budget, and a weak model left to think
        can spend all of max_tokens on it."""
        kwargs = template_kwargs(self.chat_template_kwargs, self.enable_thinking)
        if self.forces_tool_call and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = False
        return kwargs

    @property
    def calls_in_parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: a grammar binds the output (api/grammars/tool_grammar.py)."""
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def to_sampling_params(self, defaults: Iterable[tuple[str, float]] = ()) -> SamplingParams:
        return self.sampling_params(self.max_tokens_requested, self.num_top_logprobs, defaults)


class CompletionRequestModel(SamplingRequest):
    """Once validated: `prompt` is a list of prompts, each a string or a list of token ids (ids
    are checked against the vocabulary by the engine's input processor)."""

    prompt: Any = None
    logprobs: Int | None = Field(None, ge=0)
    # max_tokens 0 is vLLM's "the prompt alone", taken with echo only
    max_tokens: Int | None = Field(None, ge=0)
    echo: Bool | None = None  # the prompt (and, with logprobs, its tokens' logprobs) before the completion
    # vLLM's: each choice's `prompt_logprobs`, with this many top alternatives (at most --max-logprobs)
    prompt_logprobs: Int | None = Field(None, ge=0)
    suffix: Any = None  # refused when set

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _integral_logprobs(cls, value: Any) -> Any:
        return integral(value)

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return at_most(value, info.field_name or "logprobs", 0, limits_of(info).max_logprobs, "--max-logprobs")

    @model_validator(mode="after")
    def _normalised(self) -> CompletionRequestModel:
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        response_format = self.output_format()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1, got 0 (0 is taken with echo only)", "max_tokens")
        return self.model_copy(update={"prompt": parse_prompts(self.prompt), "response_format": response_format})

    @property
    def prompt_only(self) -> bool:
        """vLLM's echo semantics: max_tokens 0 returns the prompt alone (one token runs, unshown)."""
        return self.max_tokens == 0

    def to_sampling_params(self, defaults: Iterable[tuple[str, float]] = ()) -> SamplingParams:
        params = self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs, defaults)
        # The engine scores the prompt for `prompt_logprobs`, and for echo with logprobs.
        scored = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return replace(params, prompt_logprobs=max(scored)) if scored else params


def parse_prompts(raw: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(raw, str):
        return [_nonempty_text(raw, "prompt")]
    if not isinstance(raw, list) or not raw:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, or a list of those", "prompt"
        )
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


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _nonempty_text(text: str, param: str) -> str:
    if not text:
        raise bad_request(f"{param} must not be empty", param)
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
