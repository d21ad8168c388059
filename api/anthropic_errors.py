"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, which the
/v1/messages routes declare (api/anthropic/routes.py, api/error_shape.py). Every error those paths
can answer takes it: the app's exception handlers
(api/errors.py: validation 400, unknown model 404, 405, 408, body too large 413, a full queue 503,
a dead engine, a deadline 504, an unexpected 500) and the key middleware's 401 and 429
(api/access/keys.py) build the OpenAI body first and `to_anthropic` re-shapes it here, keeping the
status and headers (Retry-After, x-ratelimit-*). The Anthropic SDK picks its exception class from
the status (429 RateLimitError, 503 ServiceUnavailableError, ...) and reads `error.type`."""

from __future__ import annotations

import orjson
from starlette.responses import Response

# Anthropic's `error.type` names (docs.anthropic.com/en/api/errors; the SDK's ErrorType).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # a full queue, or an engine starting, stopping or dead: retry later
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(anthropic_error_body(status, message)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def to_anthropic(response: Response) -> Response:
    """An OpenAI-shaped error response (api/errors.py `error_response`) in Anthropic's shape, with
    the same status and headers; anything else (no body, 499) as it is."""
    try:
        message = orjson.loads(bytes(response.body))["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return anthropic_error_response(response.status_code, message, headers)
