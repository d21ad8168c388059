"""The Starlette app: the lifespan that loads the engine in a thread (so /health can answer 503
meanwhile) and stops it, the middleware, and the exception handlers. The server's configuration
and lifecycle live in api/state.py, the handlers in api/routes.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from api.access.keys import KeyMiddleware
from api.access.request_log import RequestLogMiddleware
from api.anthropic.routes import MESSAGES_ERROR_SHAPE, MESSAGES_ROUTES
from api.error_shape import ErrorShapeMiddleware
from api.errors import (
    APIError,
    handle_api_error,
    handle_client_disconnected,
    handle_engine_dead,
    handle_engine_overloaded,
    handle_engine_restarting,
    handle_http_exception,
    handle_param_error,
    handle_unexpected,
)
from api.http import ClientDisconnected
from api.ops.key_metrics import key_metrics_routes
from api.ops.stats import stats_routes
from api.ops.ui import ui_routes
from api.responses.routes import RESPONSES_ROUTES
from api.routes import ROUTES
from api.state import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerConfig,
    ServerState,
    load_engine,
)
from api.transport.framing import FramingMiddleware
from api.transport.inflight import InFlightMiddleware
from engine.front import EngineConfig
from engine.front.errors import EngineDeadError, EngineOverloadedError, EngineRestartingError, ParamError

if TYPE_CHECKING:
    from engine.front import AsyncEngine

__all__ = [
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "ServerConfig",
    "ServerState",
    "build_app",
    "load_engine",
]


def build_app(
    config: ServerConfig,
    loader: Callable[[EngineConfig], AsyncEngine] = load_engine,
    on_fatal: Callable[[], None] | None = None,
) -> Starlette:
    """The ASGI app; the engine loads in the background once the lifespan starts."""
    state = ServerState(config, loader, on_fatal)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load(), name="fp4serve-load")
        try:
            yield
        finally:
            if not loading.done():
                state.abandon_load()  # the engine processes being loaded are killed, the load fails
                loading.cancel()
            state.begin_shutdown()
            await state.close()

    # Outermost first: the error shape the routes declared, count and watch the client, log what is
    # refused (the framing's refusals included), then check the body's framing and size, then the key.
    middleware = [
        Middleware(ErrorShapeMiddleware, shaped_paths=[MESSAGES_ERROR_SHAPE]),
        Middleware(InFlightMiddleware, in_flight=state.in_flight),
        Middleware(
            RequestLogMiddleware,
            metrics=state.metrics,
            access_log=config.access_log,
            skipped_paths=config.access_log_skipped_paths,
        ),
        Middleware(FramingMiddleware, max_request_bytes=config.max_request_bytes),
    ]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"]
            )
        )
    middleware.append(Middleware(KeyMiddleware, ring=state.keys, limiter=state.limiter))
    app = Starlette(
        routes=[
            *ROUTES,
            *RESPONSES_ROUTES,
            *MESSAGES_ROUTES,
            *stats_routes(),
            *key_metrics_routes(),
            *(ui_routes(config.url) if config.ui else []),
        ],
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: handle_api_error,
            ParamError: handle_param_error,
            EngineOverloadedError: handle_engine_overloaded,
            EngineDeadError: handle_engine_dead,
            EngineRestartingError: handle_engine_restarting,
            ClientDisconnected: handle_client_disconnected,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    app.state.server = state
    return app
