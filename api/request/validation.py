"""What every protocol's request models (pydantic v2) share: the strict JSON types, the base
`RequestModel` (unknown fields ignored, JSON null counted as absent, integral floats taken as integers),
the server's `RequestLimits` as validators (handed in as the validation context), and `validate`:
a body into a model, a `ValidationError` into OpenAI's 400 with `param` from the error's location.
A validator may raise `APIError` itself (api/request/messages.py does, naming a nested parameter): pydantic
lets any error but a ValueError through as it is."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AllowInfNan, BaseModel, ConfigDict, Strict, ValidationError, ValidationInfo, field_validator

from api.access.limits import RequestLimits
from api.errors import APIError, bad_request

DEFAULT_LIMITS = RequestLimits()
# Nesting a request's free-form JSON (tool schemas, tool-call arguments, metadata) may have: the
# templates' `tojson` and the response's serializer recurse, and past a few hundred levels they fail
# with Python's own words. One schema level is two JSON levels (properties -> name -> schema), so
# this is response_format's 64 schema levels (api/grammars/response_format.py MAX_CHECK_DEPTH).
MAX_JSON_DEPTH = 128


def limits_of(info: ValidationInfo) -> RequestLimits:
    """The server's limits (--max-n, ...), handed in as the validation context."""
    return (info.context or {}).get("limits") or DEFAULT_LIMITS


def at_most(value: int | None, name: str, low: int, cap: int, flag: str) -> int | None:
    if value is not None and value > cap:
        raise ValueError(f"{name} must be between {low} and {cap} on this server ({flag}), got {value}")
    return value


def too_many(name: str, count: int, cap: int, flag: str) -> ValueError:
    return ValueError(f"{name} has {count} entries; this server allows at most {cap} ({flag})")


def stop_limit(value: Any, name: str, info: ValidationInfo) -> Any:
    """Stop strings (one, or a list) within --max-stop and --max-stop-length."""
    limits = limits_of(info)
    stop = [value] if isinstance(value, str) else (value or [])
    if len(stop) > limits.max_stop:
        raise too_many(name, len(stop), limits.max_stop, "--max-stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_length:
        raise ValueError(
            f"{name} has a string of {longest} characters; this server allows at most "
            f"{limits.max_stop_length} (--max-stop-length)"
        )
    return value


def check_depth(value: Any, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """A 400 naming `param` when `value` nests objects and arrays deeper than `limit`. Iterative,
    so any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            raise bad_request(f"{param} is nested deeper than {limit} levels", param)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def integral(value: Any) -> Any:
    """Some clients serialise every number as a float: 12.0 is the integer 12."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, Strict()]  # integral floats are taken too (RequestModel._integral_floats)
Number = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Str | None = None

    # NOTE: a validator on the fields, not a BeforeValidator in `Int`: that would hide the ranges
    # from /openapi.json.
    @field_validator(
        "n",
        "max_tokens",
        "min_tokens",
        "top_k",
        "seed",
        "top_logprobs",
        "max_completion_tokens",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _integral_floats(cls, value: Any) -> Any:
        return integral(value)


class ToolsRequest(RequestModel):
    """`tools` (each protocol reads its own shapes), at most --max-tools of them."""

    tools: Any = None

    @field_validator("tools")
    @classmethod
    def _tools_limit(cls, value: Any, info: ValidationInfo) -> Any:
        cap = limits_of(info).max_tools
        if isinstance(value, list) and len(value) > cap:
            raise too_many("tools", len(value), cap, "--max-tools")
        return value


def validate(model: type[RequestModel], body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> Any:
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
        relation = {
            "greater_than_equal": "at least",
            "less_than_equal": "at most",
            "greater_than": "greater than",
            "less_than": "less than",
        }[kind]
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
