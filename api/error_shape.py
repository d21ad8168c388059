"""Which protocol's shape a request's error responses take, chosen once, where the routes are
declared: a route module names the path it serves and its shape (api/anthropic/routes.py:
Anthropic's on /v1/messages), `ErrorShapeMiddleware`, outermost, puts that shape in the request's
scope["state"] before anything can refuse it (the body's framing, the key, a 404 or 405), and every
general layer (api/errors.py, api/access/keys.py, api/transport/framing.py) builds OpenAI's body
and passes it through `shaped`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

# An OpenAI-shaped error response (api/errors.py `error_response`) -> the same error in a protocol's
# shape, with its status and headers.
ErrorShape = Callable[[Response], Response]

ERROR_SHAPE_KEY = "fp4serve.error_shape"  # the request's ErrorShape, in scope["state"]


def openai_shape(response: Response) -> Response:
    """OpenAI's shape: the body as api/errors.py builds it, for every path no route claims."""
    return response


@dataclass(frozen=True)
class ShapedPath:
    """A route's path, and every path below it, whose errors take `shape`."""

    path: str
    shape: ErrorShape

    def covers(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path + "/")


class ErrorShapeMiddleware:
    """Pure ASGI, outermost: the request's error shape, from the routes' declarations, in its
    scope["state"]. NOTE: set on the scope itself, not a copy, so that Starlette's outermost
    handler of unexpected errors, which holds that scope, answers in the same shape."""

    def __init__(self, app: ASGIApp, shaped_paths: Sequence[ShapedPath]) -> None:
        self.app = app
        self.shaped_paths = tuple(shaped_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            shape = next((s.shape for s in self.shaped_paths if s.covers(scope["path"])), openai_shape)
            scope.setdefault("state", {})[ERROR_SHAPE_KEY] = shape
        await self.app(scope, receive, send)


def shaped(scope: Scope, response: Response) -> Response:
    """An OpenAI-shaped error response in the shape the request's route declared."""
    shape: ErrorShape = scope.get("state", {}).get(ERROR_SHAPE_KEY, openai_shape)
    return shape(response)
