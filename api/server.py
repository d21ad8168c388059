"""`Server`: runs the app under hypercorn until SIGTERM / SIGINT (or a fatal error), then drains:
/health turns 503 and new requests get 503 while in-flight ones finish, up to the shutdown
timeout; what is still running then ends with an error (an SSE error event, or a 503 body).
A second signal ends the wait at once. The exit code is 0 after a drain, 1 after a fatal error."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from api.app import ServerConfig, build_app, load_engine
from api.transport.deadline import server_stopping_error
from engine.front import AsyncEngine, EngineConfig

logger = logging.getLogger("fp4serve")

# After the drain: how long hypercorn lets connections finish writing before it cuts them, and
# how long ended requests get to send their last event.
GRACEFUL_TIMEOUT_S = 5.0
CUT_GRACE_S = 5.0
EXIT_OK = 0
EXIT_FAILED = 1


class Server:
    def __init__(
        self,
        config: ServerConfig,
        loader: Callable[[EngineConfig], AsyncEngine] = load_engine,
        log_level: str = "info",
    ) -> None:
        self.config = config
        self.log_level = log_level
        self.app = build_app(config, loader, on_fatal=self._on_fatal)
        self.state = self.app.state.server
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()  # begin the drain
        self._hurry = asyncio.Event()  # stop waiting for in-flight requests

    async def run(self, handle_signals: bool = True) -> int:
        """Serve until stopped; returns the process exit code."""
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config as HypercornConfig

        from api.transport.hypercorn_h2 import mend_hypercorn_h2

        mend_hypercorn_h2(self.config.body_timeout_s)

        self._loop = asyncio.get_running_loop()
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._on_signal, sig.name)
            # Swaps the key records in one assignment: requests in flight keep theirs.
            self._loop.add_signal_handler(signal.SIGHUP, self.state.keys.reload)
        hc = HypercornConfig()
        host, port = self.config.host, self.config.port
        hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        hc.accesslog = None  # the engine logs one line per finished request
        hc.loglevel = self.log_level.upper()
        hc.graceful_timeout = GRACEFUL_TIMEOUT_S
        log_settings(self.config)
        await hypercorn_serve(self.app, hc, shutdown_trigger=self._drain)  # type: ignore[arg-type]
        return EXIT_FAILED if self.state.phase == "failed" else EXIT_OK

    def stop(self) -> None:
        """What SIGTERM does; callable from any thread once run() has started."""
        assert self._loop is not None, "the server is not running"
        self._loop.call_soon_threadsafe(self._on_signal, "stop()")

    def _on_signal(self, name: str) -> None:
        if self._stop.is_set():
            logger.warning("%s again: ending the %d in-flight requests now", name, self.state.in_flight.count)
            self._hurry.set()
            return
        logger.info("%s: shutting down; /health answers 503 and new requests are refused", name)
        self._stop.set()

    def _on_fatal(self) -> None:
        # Nothing worth waiting for: the failure already ended every request in flight.
        self._hurry.set()
        self._stop.set()

    async def _drain(self) -> None:
        """hypercorn's shutdown trigger: it stops accepting connections once this returns, so
        load balancers see /health 503 for the whole drain."""
        await self._stop.wait()
        state = self.state
        state.begin_shutdown()
        in_flight = state.in_flight
        if in_flight.count:
            logger.info("waiting up to %g s for %d in-flight requests", self.config.shutdown_timeout_s, in_flight.count)
        if await in_flight.wait_idle(self.config.shutdown_timeout_s, self._hurry):
            return
        ended = in_flight.expire_all(server_stopping_error())
        logger.warning("shutdown: ended %d requests that were still running", ended)
        if not await in_flight.wait_idle(CUT_GRACE_S):
            logger.warning("shutdown: %d requests did not end; their connections will be closed", in_flight.count)


def log_settings(config: ServerConfig) -> None:
    """The serving limits, once at start-up. NOTE: the API key is never logged, only whether one is set."""
    limits, queue = config.limits, config.queue
    logger.info(
        "limits: body %d bytes, n <= %d, max_tokens <= %s, logprobs <= %d, stop <= %d x %d chars, tools <= %d; "
        "queue <= %s requests / %s tokens; request timeout %s; shutdown timeout %g s; API key %s; CORS %s",
        config.max_request_bytes,
        limits.max_n,
        limits.max_output_tokens or "context",
        limits.max_logprobs,
        limits.max_stop,
        limits.max_stop_length,
        limits.max_tools,
        queue.max_queued_requests or "unbounded",
        queue.max_queued_tokens or "unbounded",
        f"{config.request_timeout_s:g} s" if config.request_timeout_s else "none",
        config.shutdown_timeout_s,
        "required" if config.api_key or config.api_keys_file else "not required",
        ", ".join(config.cors_origins) or "off",
    )
    if config.api_keys_file:
        from api.access.keys import parse_keys_file

        names = [r.name for r in parse_keys_file(config.api_keys_file)]
        logger.info("API keys from %s: %s", config.api_keys_file, ", ".join(names))
    logger.info(
        "scheduling policy %s, long prefill threshold %s tokens, body timeout %g s, <= %d prompts per completion",
        config.engine.scheduling_policy,
        config.engine.long_prefill_token_threshold or "no",
        config.body_timeout_s,
        config.max_prompts,
    )
