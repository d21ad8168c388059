"""OpenAI-style error bodies: `APIError` (what handlers raise) and the Starlette exception
handlers that turn it, the engine's refusals, routing errors and unexpected failures into
`{"error": {"message", "type", "param", "code"}}` — or in the shape the request's route declared
(api/error_shape.py: Anthropic's on /v1/messages)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from api.error_shape import shaped
from engine.front.errors import EngineDeadError, EngineOverloadedError, EngineRestartingError, ParamError

logger = logging.getLogger("fp4serve.api")

CLIENT_CLOSED = 499
# Where a handler leaves the error it answered, in the request's scope["state"], for the refusal's
# log line and metric (api/access/request_log.py): its OpenAI fields, whatever shape the body takes.
ERROR_STATE = "fp4serve.error"

# The OpenAI `type` for each status we send; the SDK picks its exception class from the status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
}

# A full queue: 503 with Retry-After, which the OpenAI SDK retries (twice by default), and a
# `type` of its own so clients and dashboards can tell shedding from an outage.
OVERLOADED_TYPE = "overloaded_error"
OVERLOADED_CODE = "server_overloaded"
OVERLOADED_RETRY_AFTER_S = 1
RESTARTING_RETRY_AFTER_S = 2  # the retry waits in the queue for the new engine, so any small value does


class APIError(Exception):
    """A request the server refuses; carries everything the error body needs."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "invalid_request_error")


@dataclass(frozen=True)
class ErrorBody:
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def as_dict(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(why: str) -> APIError:
    return APIError(
        503,
        f"the server is overloaded: {why}; retry after {OVERLOADED_RETRY_AFTER_S} s",
        code=OVERLOADED_CODE,
        headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)},
        type_=OVERLOADED_TYPE,
    )


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
) -> ErrorBody:
    return ErrorBody(message=message, type=type_ or _TYPES.get(status, "invalid_request_error"), param=param, code=code)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    type_: str | None = None,
) -> Response:
    body = orjson.dumps(error_body(status, message, param, code, type_).as_dict())
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def answer(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    type_: str | None = None,
) -> Response:
    """The error response in the route's shape, its fields left in the request's state for the
    refusal's log line (api/access/request_log.py)."""
    body = error_body(status, message, param, code, type_)
    request.scope.setdefault("state", {})[ERROR_STATE] = body
    return shaped(request.scope, error_response(status, message, param, code, headers, body.type))


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError), f"registered for APIError, got {type(exc).__name__}"
    return answer(request, exc.status, exc.message, exc.param, exc.code, exc.headers, exc.type)


async def handle_engine_overloaded(request: Request, exc: Exception) -> Response:
    """The queue is full (engine/front/admission.py: the early check before tokenizing, or the engine's
    own where the request is added): 503 `overloaded_error` with Retry-After."""
    assert isinstance(exc, EngineOverloadedError), f"registered for EngineOverloadedError, got {type(exc).__name__}"
    return await handle_api_error(request, overloaded(str(exc)))


async def handle_engine_dead(request: Request, exc: Exception) -> Response:
    """The engine died between the ready check and the request's admission."""
    assert isinstance(exc, EngineDeadError), f"registered for EngineDeadError, got {type(exc).__name__}"
    # The process is on its way out (api/app.py); a retry lands on its restarted successor.
    return answer(request, 503, f"{exc}; see the server log", code="engine_dead", headers={"Retry-After": "5"})


async def handle_engine_restarting(request: Request, exc: Exception) -> Response:
    """The engine process was lost before this request's first output; the retry waits for the
    new engine (engine/client/supervisor.py), which the OpenAI and Anthropic SDKs do by themselves."""
    assert isinstance(exc, EngineRestartingError), f"registered for EngineRestartingError, got {type(exc).__name__}"
    return answer(
        request, 503, str(exc), code="engine_restarting", headers={"Retry-After": str(RESTARTING_RETRY_AFTER_S)}
    )


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method), in OpenAI's shape."""
    assert isinstance(exc, HTTPException), f"registered for HTTPException, got {type(exc).__name__}"
    if exc.status_code == 404:
        message, code = f"no route for {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return answer(request, exc.status_code, message, code=code, headers=dict(exc.headers or {}))


async def handle_param_error(request: Request, exc: Exception) -> Response:
    """What the engine and SamplingParams raise for a user mistake (scheduler/request.py)."""
    assert isinstance(exc, ParamError), f"registered for ParamError, got {type(exc).__name__}"
    return answer(request, 400, exc.message, exc.param, exc.code)


async def handle_client_disconnected(request: Request, exc: Exception) -> Response:
    # Nobody reads this; 499 is the status nginx logs for a client that closed first.
    return Response(status_code=CLIENT_CLOSED)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # NOTE: the body never carries the exception text: it may hold paths or internals. The
    # traceback goes to the log, where an operator can read it.
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return shaped(
        request.scope, error_response(500, "internal server error; see the server log", code="internal_error")
    )
