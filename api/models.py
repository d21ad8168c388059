"""Typed request models (pydantic v2) of the OpenAI protocol and vLLM's /tokenize and
/detokenize: each field's JSON type and OpenAI's documented range is declared once here; unknown
fields are ignored; JSON null counts as absent. A `ValidationError` becomes OpenAI's 400 body with
`param` taken from the error's location (`request_error`). The nested shapes with their own
parameter paths (messages, tools, tool_choice, response_format) are read by api/messages.py and
api/response_format.py; api/protocol.py turns a model into the frozen request the routes use."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from api.errors import APIError, bad_request

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


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
    speculative_decoding: Bool | None = None  # false: this request never drafts (extra body field)


class ChatCompletionRequest(SamplingRequest):
    messages: Any = None  # api/messages.py
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: Bool | None = None
    add_generation_prompt: Bool | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0)
    max_completion_tokens: Int | None = Field(None, ge=1)


class CompletionRequestModel(SamplingRequest):
    prompt: Any = None  # api/protocol.py parse_prompts
    logprobs: Int | None = Field(None, ge=0)
    echo: Any = None  # refused when set
    suffix: Any = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _integral_logprobs(cls, value: Any) -> Any:
        return _integral(value)


class TokenizeRequestModel(Request):
    prompt: Str | None = None
    messages: Any = None
    tools: Any = None
    add_generation_prompt: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: Bool | None = None
    add_special_tokens: Bool | None = None
    return_token_strs: Bool | None = None


class DetokenizeRequestModel(Request):
    tokens: Annotated[Any, AfterValidator(_token_id_list)] = None


def validate(model: type[Request], body: dict[str, Any]) -> Any:
    """The body as `model`; APIError (400 naming the parameter) when a field is wrong."""
    try:
        return model.model_validate(body)
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

    _, schemas = models_json_schema(
        [(model, "validation") for model in _REQUEST_BODIES.values()], ref_template="#/components/schemas/{model}"
    )
    paths = {
        path: {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK"}, "400": {"description": "OpenAI error body naming `param`"}},
        }}
        for path, model in _REQUEST_BODIES.items()
    }
    return {"openapi": "3.1.0", "info": {"title": "fp4serve", "version": version}, "paths": paths,
            "components": {"schemas": schemas.get("$defs", {})}}
