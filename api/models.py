"""Typed request models (pydantic v2) of the OpenAI protocol and vLLM's /tokenize and
/detokenize: each field's JSON type and OpenAI's documented range is declared once here; unknown
fields are ignored; JSON null counts as absent. A `ValidationError` becomes OpenAI's 400 body with
`param` taken from the error's location (`request_error`). The nested shapes with their own
parameter paths (messages, tools, tool_choice, response_format) are read by api/messages.py and
api/response_format.py; api/protocol.py turns a model into the frozen request the routes use."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from api.errors import APIError, bad_request
from api.limits import RequestLimits

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
DEFAULT_LIMITS = RequestLimits()


def _limits(info: ValidationInfo) -> RequestLimits:
    """The server's limits (--max-n, ...), handed in as the validation context."""
    return (info.context or {}).get("limits") or DEFAULT_LIMITS


def _at_most(value: int | None, name: str, low: int, cap: int, flag: str) -> int | None:
    if value is not None and value > cap:
        raise ValueError(f"{name} must be between {low} and {cap} on this server ({flag}), got {value}")
    return value


def _too_many(name: str, count: int, cap: int, flag: str) -> ValueError:
    return ValueError(f"{name} has {count} entries; this server allows at most {cap} ({flag})")


def _output_cap(value: int | None, name: str, limits: RequestLimits) -> int | None:
    cap = limits.max_output_tokens
    if value is not None and cap is not None and value > cap:
        raise ValueError(f"{name} is {value}; this server generates at most {cap} tokens per request (--max-output-tokens)")
    return value


def _integral(value: Any) -> Any:
    """Some clients serialise every number as a float: 12.0 is the integer 12."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, Strict()]  # integral floats are taken too (Request._integral_floats)
Number = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


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


def _token_id_list(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError("must be a list of token ids")
    return value


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Str | None = None

    # NOTE: a validator on the fields, not a BeforeValidator in `Int`: that would hide the ranges
    # from /openapi.json.
    @field_validator("n", "max_tokens", "min_tokens", "top_k", "seed", "top_logprobs", "max_completion_tokens",
                     mode="before", check_fields=False)
    @classmethod
    def _integral_floats(cls, value: Any) -> Any:
        return _integral(value)


class StreamOptionsModel(Request):
    include_usage: Bool | None = None


class ToolsRequest(Request):
    """`tools` (shapes read by api/messages.py), at most --max-tools of them."""

    tools: Any = None

    @field_validator("tools")
    @classmethod
    def _tools_limit(cls, value: Any, info: ValidationInfo) -> Any:
        cap = _limits(info).max_tools
        if isinstance(value, list) and len(value) > cap:
            raise _too_many("tools", len(value), cap, "--max-tools")
        return value


class SamplingRequest(Request):
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
    stop_token_ids: Annotated[Any, AfterValidator(_token_id_list)] = None
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    stream: Bool | None = None
    stream_options: StreamOptionsModel | None = None
    return_token_ids: Bool | None = None
    response_format: Any = None  # api/response_format.py
    priority: Int | None = Field(None, ge=-(1 << 31), le=(1 << 31) - 1)  # vLLM's: lower is served first
    speculative_decoding: Bool | None = None  # false: this request never drafts (extra body field)

    # ---- the server's limits, as validators ----------------------------------------------------
    @field_validator("n")
    @classmethod
    def _n_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _at_most(value, "n", 1, _limits(info).max_n, "--max-n")

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _output_cap(value, "max_tokens", _limits(info))

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: Any, info: ValidationInfo) -> Any:
        limits = _limits(info)
        stop = [value] if isinstance(value, str) else (value or [])
        if len(stop) > limits.max_stop:
            raise _too_many("stop", len(stop), limits.max_stop, "--max-stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > limits.max_stop_length:
            raise ValueError(f"stop has a string of {longest} characters; this server allows at most "
                             f"{limits.max_stop_length} (--max-stop-length)")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_limit(cls, value: Any, info: ValidationInfo) -> Any:
        limits = _limits(info)
        if value is not None and len(value) > limits.max_stop:
            raise _too_many("stop_token_ids", len(value), limits.max_stop, "--max-stop")
        return value


class ChatCompletionRequest(SamplingRequest, ToolsRequest):
    messages: Any = None  # api/messages.py
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
        return _at_most(value, "top_logprobs", 0, _limits(info).max_logprobs, "--max-logprobs")

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _output_cap(value, "max_completion_tokens", _limits(info))


class CompletionRequestModel(SamplingRequest):
    prompt: Any = None  # api/protocol.py parse_prompts
    logprobs: Int | None = Field(None, ge=0)
    # max_tokens 0 is vLLM's "the prompt alone", taken with echo only (api/protocol.py)
    max_tokens: Int | None = Field(None, ge=0)
    echo: Bool | None = None  # the prompt (and, with logprobs, its tokens' logprobs) before the completion
    # vLLM's: each choice's `prompt_logprobs`, with this many top alternatives (at most --max-logprobs)
    prompt_logprobs: Int | None = Field(None, ge=0)
    suffix: Any = None  # refused when set

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _integral_logprobs(cls, value: Any) -> Any:
        return _integral(value)

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _at_most(value, info.field_name or "logprobs", 0, _limits(info).max_logprobs, "--max-logprobs")


class TokenizeRequestModel(ToolsRequest):
    prompt: Str | None = None
    messages: Any = None
    add_generation_prompt: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: Bool | None = None
    add_special_tokens: Bool | None = None
    return_token_strs: Bool | None = None


class DetokenizeRequestModel(Request):
    tokens: Annotated[Any, AfterValidator(_token_id_list)] = None


def validate(model: type[Request], body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> Any:
    """The body as `model` within the server's `limits`; APIError (400 naming the parameter)
    when a field is wrong."""
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as e:
        raise request_error(e) from None


def request_error(error: ValidationError) -> APIError:
    """OpenAI's 400 for the first problem pydantic found, `param` from its location."""
    first = error.errors(include_url=False)[0]
    param = _param(first["loc"])
    kind, ctx, value = first["type"], first.get("ctx") or {}, first.get("input")
    got = _json_type(value)
    if kind == "value_error":
        text = str(ctx.get("error", first["msg"]))
        message = text if text.startswith(param.split(".")[0]) else f"{param} {text}"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        bound = next(iter(ctx.values()))
        relation = {"greater_than_equal": "at least", "less_than_equal": "at most",
                    "greater_than": "greater than", "less_than": "less than"}[kind]
        message = f"{param} must be {relation} {bound}, got {value}"
    elif kind.startswith("int"):
        message = f"{param} must be an integer, got {got}"
    elif kind.startswith("float") or kind == "finite_number":
        message = f"{param} must be a number, got {got}"
    elif kind.startswith("bool"):
        message = f"{param} must be a boolean, got {got}"
    elif kind.startswith("string"):
        message = f"{param} must be a string, got {got}"
    elif kind in ("dict_type", "model_type", "model_attributes_type"):
        message = f"{param} must be an object, got {got}"
    else:
        message = f"{param}: {first['msg']}"
    return bad_request(message, param or None)


def _param(loc: tuple[int | str, ...]) -> str:
    """('stream_options', 'include_usage') -> 'stream_options.include_usage'; ('stop', 1) -> 'stop[1]'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return f"number {value}"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


# ---- /openapi.json -------------------------------------------------------------------------------------
_REQUEST_BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequestModel,
    "/tokenize": TokenizeRequestModel,
    "/detokenize": DetokenizeRequestModel,
}


def openapi_schema(version: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document of the request bodies, generated from the models above."""
    from pydantic.json_schema import models_json_schema

    # NOTE: imported here: those modules build on this one.
    from api.anthropic_request import MessagesRequestModel
    from api.responses_request import ResponsesRequestModel

    bodies = {**_REQUEST_BODIES, "/v1/responses": ResponsesRequestModel, "/v1/messages": MessagesRequestModel,
              "/v1/messages/count_tokens": MessagesRequestModel}
    _, schemas = models_json_schema(
        [(model, "validation") for model in dict.fromkeys(bodies.values())], ref_template="#/components/schemas/{model}"
    )
    paths = {
        path: {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK"}, "400": {"description": "OpenAI error body naming `param`"}},
        }}
        for path, model in bodies.items()
    }
    return {"openapi": "3.1.0", "info": {"title": "fp4serve", "version": version}, "paths": paths,
            "components": {"schemas": schemas.get("$defs", {})}}
