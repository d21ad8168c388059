"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for the
/v1/messages routes (the Anthropic SDK picks its exception class from the status)."""

from __future__ import annotations

import orjson
from starlette.responses import Response

MESSAGES_PREFIX = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(status, "invalid_request_error"), "message": message}}


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(anthropic_error_body(status, message)), status_code=status,
                    media_type="application/json", headers=headers)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")
