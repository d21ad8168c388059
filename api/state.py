"""The server's configuration (`ServerConfig`) and its lifecycle (`ServerState`: loading → ready →
stopping, or failed — a failed load, or an engine that died and will not be restarted): the one
mutable object of the app, which the routes read. While the engine process restarts
(engine/client/supervisor.py) the phase stays ready: requests wait for the new engine, and /health
answers 503 `restarting` (`health`). Its own module, so api/app.py (the Starlette app) and api/routes.py (the
handlers) both import it and not each other."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from api.access.keys import KeyRing
from api.access.limits import RequestLimits
from api.access.rate_limit import RateLimiter
from api.errors import APIError
from api.parsers import ParserSettings
from api.transport.inflight import InFlight
from api.transport.metrics import ServerMetrics
from engine.front import MAX_TOKENS_POLICIES, EngineConfig, MaxTokensPolicy, QueueLimits
from engine.front.errors import ConfigError

if TYPE_CHECKING:
    from engine.front import AsyncEngine

logger = logging.getLogger("fp4serve")

T = TypeVar("T")
Phase = Literal["loading", "ready", "failed", "stopping"]
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (api/body.py)
DEFAULT_MAX_PROMPTS = 64  # prompts in one /v1/completions request


@dataclass(frozen=True)
class ServerConfig:
    """What the operator chose for the HTTP side; `engine` is handed to the engine as is."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # NOTE: never in a repr, so never in a log
    cors_origins: tuple[str, ...] = ()
    tool_parser: str | None = None  # a name from api/parsers, or "auto" (from the chat template)
    reasoning_parser: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    limits: RequestLimits = RequestLimits()
    queue: QueueLimits = QueueLimits(max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS)
    request_timeout_s: float | None = None  # from arrival to the last byte; None: no limit
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # how long a drain waits for in-flight requests
    ui: bool = True  # the web page at / (api/ops/ui.py)
    api_keys_file: str | None = None  # TOML [[keys]] (api/access/keys.py); exclusive with api_key
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_prompts: int = DEFAULT_MAX_PROMPTS
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (LRU); 0: none
    max_tokens_policy: MaxTokensPolicy = "clamp"  # a max_tokens beyond the context's room: clamp | reject
    access_log: bool = False  # one INFO line per request (api/access/request_log.py); refusals are logged regardless
    access_log_skipped_paths: tuple[str, ...] = ("/health", "/metrics")

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port: must be in 1..65535, got {self.port}")
        if self.max_request_bytes <= 0:
            raise ConfigError(f"--max-request-bytes: must be positive, got {self.max_request_bytes}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"--request-timeout: must be positive, got {self.request_timeout_s}")
        if self.responses_store_size < 0:
            raise ConfigError(f"--responses-store-size: must not be negative, got {self.responses_store_size}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"--shutdown-timeout: must not be negative, got {self.shutdown_timeout_s}")
        if self.body_timeout_s <= 0:
            raise ConfigError(f"--body-timeout: must be positive, got {self.body_timeout_s}")
        if self.max_prompts < 1:
            raise ConfigError(f"--max-prompts: must be positive, got {self.max_prompts}")
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ConfigError(
                f"--max-tokens-policy: '{self.max_tokens_policy}' is not one of {', '.join(MAX_TOKENS_POLICIES)}"
            )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def load_engine(config: EngineConfig) -> AsyncEngine:
    from engine.front import (
        AsyncEngine,  # torch and the model: only once we serve
    )

    # xgrammar (and the torch and transformers it imports) comes in for the first request with a
    # grammar, off the event loop; on a thread beside the load, so the engine process starts at
    # once instead of seconds later, and both imports run side by side.
    errors: list[BaseException] = []
    checks = threading.Thread(target=_prepare_checks, args=(errors,), name="fp4serve-grammar-import", daemon=True)
    checks.start()
    engine = AsyncEngine.from_config(config)
    checks.join()
    if errors:
        for client in engine.clients:  # not started yet: nothing to drain
            client.shutdown()
        raise errors[0]
    return engine


def _prepare_checks(errors: list[BaseException]) -> None:
    try:
        from engine.front import StructuredOutputs

        StructuredOutputs.prepare_checks()
    except BaseException as e:  # re-raised by load_engine, as if imported on its thread
        errors.append(e)


class ServerState:
    """The one mutable object of the app, on `app.state.server`; touched on the loop only."""

    def __init__(
        self,
        config: ServerConfig,
        loader: Callable[[EngineConfig], AsyncEngine] = load_engine,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.phase: Phase = "loading"
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None  # why the phase is "failed"
        self.parsers = ParserSettings()
        self.metrics = ServerMetrics()
        self.in_flight = InFlight(config.request_timeout_s, self.metrics)
        self.keys = KeyRing(config.api_key, config.api_keys_file)
        self.limiter = RateLimiter(self.tokens_used, self.metrics)
        self.started_at = int(time.time())
        self._loader = loader
        self._on_fatal = on_fatal
        # Chat templates and tokenization run here, off the event loop; one worker keeps a
        # burst of huge prompts from crowding out the engine's own step thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4serve-prompt")

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 the OpenAI SDK retries (it honours Retry-After)."""
        if self.phase != "ready" or self.engine is None:
            raise APIError(503, self.unavailable_reason(), code=f"server_{self.phase}", headers={"Retry-After": "2"})
        if getattr(self.engine, "dead", False):
            raise APIError(503, "the engine stopped after a failure; see the server log", code="engine_dead")
        return self.engine

    def tokens_used(self, key: str) -> int:
        """A key's prompt + completion tokens since start (the output processor counts them)."""
        usage = self.engine.metrics.usage.get(key) if self.engine is not None else None
        return 0 if usage is None else usage.prompt_tokens + usage.completion_tokens

    def unavailable_reason(self) -> str:
        if self.phase == "failed" and self.engine is not None:
            return f"the engine stopped ({self.load_error}); the server is exiting so that it can be restarted"
        return {
            "loading": "the model is still loading",
            "failed": f"the model failed to load: {self.load_error}",
            "stopping": "the server is shutting down",
        }.get(self.phase, "the server is not ready")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    async def load(self) -> None:
        logger.info(
            "loading %s; /health answers 503 until it is ready", self.config.engine.model or "the default model"
        )
        try:
            engine = await _in_daemon_thread(self._loader, self.config.engine)
            if self.phase == "stopping":  # the server stopped while it loaded: nobody will serve it
                await engine.shutdown()
                return
            self.parsers = _resolve_parsers(self.config, engine.tokenizer.chat_template)
            await engine.start(
                self.config.queue, on_dead=self._engine_died, max_output_tokens=self.config.limits.max_output_tokens
            )
            engine.input_processor.max_tokens_policy = self.config.max_tokens_policy
        except Exception as e:
            if self.phase == "stopping":  # the shutdown killed the engine being loaded (`abandon_load`)
                logger.info("loading stopped by the shutdown (%s)", e)
                return
            self._fail(e)
            return
        self.engine = engine
        if self.phase == "loading":  # not if shutdown began meanwhile
            self.phase = "ready"
        _log_ready(engine, self.config, self.parsers)

    def _fail(self, error: Exception) -> None:
        if isinstance(error, ConfigError):  # a bad checkpoint or flag: its one line says it all
            logger.error("start-up failed: %s", error)
            self.load_error = str(error)
        else:
            logger.error("start-up failed", exc_info=error)
            self.load_error = f"{type(error).__name__}: {error}"
        self.phase = "failed"
        if self._on_fatal is not None:
            self._on_fatal()

    def _engine_died(self, reason: str) -> None:
        """The engine cannot serve any more, and will not be restarted here: /health turns 503 and
        the process exits non-zero, so that systemd (or whatever started it) can restart it. Every
        in-flight request has had its error already."""
        logger.critical("the engine stopped (%s): exiting with status 1", reason)
        self.load_error = reason
        self.phase = "failed"
        if self._on_fatal is not None:
            self._on_fatal()

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health's status code and body: 200 `ok` only while an engine is serving (with data
        parallel, while one of its cores is; `engines` lists every core)."""
        engine = self.engine
        if self.phase != "ready" or engine is None:
            return 503, {
                "status": self.phase,
                "error": {"message": self.unavailable_reason(), "type": "unavailable_error"},
            }
        cores = engine.core_statuses()
        restarts = [(core.last_restart, i) for i, core in enumerate(cores) if core.last_restart is not None]
        last, last_core = max(restarts, key=lambda pair: pair[0].at, default=(None, 0))
        body: dict[str, Any] = {
            "status": "ok",
            "engine_pid": cores[0].pid,
            "engine_restarts": sum(core.num_restarts for core in cores),
            "last_restart": None
            if last is None
            else {
                "engine": last_core,
                "reason": last.reason,
                "detail": last.detail,
                "at": int(last.at),
                "duration_s": None if last.duration_s is None else round(last.duration_s, 1),
            },
            "engines": [
                {"index": i, "pid": core.pid, "state": core.state, "restarts": core.num_restarts}
                for i, core in enumerate(cores)
            ],
        }
        if all(core.state == "restarting" for core in cores):
            assert last is not None, "a restart has a cause"
            message = f"the engine was lost ({last.detail}) and is restarting; requests wait for it"
            return 503, {**body, "status": "restarting", "error": {"message": message, "type": "unavailable_error"}}
        info = engine.info
        return 200, {
            **body,
            "model": info.model_name,
            "device": info.device,
            "attention_backend": info.attention_backend,
            "dtype": info.dtype,
            "max_model_len": info.max_model_len,
            "kv_capacity_tokens": info.kv_capacity_tokens,
        }

    def abandon_load(self) -> None:
        """The server stops before the engine is ready: kill the engine processes being loaded, so
        the exit does not wait for the model (an in-process load cannot be stopped, but runs on a
        daemon thread, which the exit does not wait for)."""
        self.begin_shutdown()
        from engine.front import AsyncEngine

        if killed := AsyncEngine.abandon_loads():
            logger.info(
                "stopped while loading: killed %d engine process%s being loaded", killed, "" if killed == 1 else "es"
            )

    def begin_shutdown(self) -> None:
        if self.phase in ("loading", "ready"):
            self.phase = "stopping"

    async def close(self) -> None:
        self.begin_shutdown()
        if self.engine is not None:
            await self.engine.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)


async def _in_daemon_thread(fn: Callable[[EngineConfig], AsyncEngine], config: EngineConfig) -> AsyncEngine:
    """`fn(config)` on a daemon thread: unlike asyncio.to_thread's, the process exit never waits
    for it (a load the shutdown abandoned)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[AsyncEngine] = loop.create_future()

    def settle(result: AsyncEngine | None, error: BaseException | None) -> None:
        if done.done():  # the load task was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(config), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed: the server has gone
            pass

    threading.Thread(target=run, name="fp4serve-load", daemon=True).start()
    return await done


def _resolve_parsers(config: ServerConfig, chat_template: str | None) -> ParserSettings:
    """Parser names with `auto` chosen from the chat template; UnknownParserError for a bad one."""
    if config.tool_parser is None and config.reasoning_parser is None:
        return ParserSettings()
    from api.parsers import UnknownParserError, resolve_reasoning_parser, resolve_tool_parser

    try:
        return ParserSettings(
            tool_parser=resolve_tool_parser(config.tool_parser, chat_template),
            reasoning_parser=resolve_reasoning_parser(config.reasoning_parser, chat_template),
        )
    except UnknownParserError as e:
        raise ConfigError(f"--{e.kind}-parser: {e}") from None


def _log_ready(engine: AsyncEngine, config: ServerConfig, parsers: ParserSettings) -> None:
    info = engine.info
    cores = len(engine.clients)
    logger.info(
        "fp4serve %s ready: model %s (%s%s), dtype %s, device %s, attention %s, max_model_len %d, "
        "KV cache %d tokens (%d pages of %d)%s, tool parser %s, reasoning parser %s, max_tokens policy %s; "
        "serving at %s/v1",
        info.version,
        info.model_name,
        info.model_path,
        ", demo weights" if info.is_demo else "",
        info.dtype,
        info.device,
        info.attention_backend,
        info.max_model_len,
        info.kv_capacity_tokens,
        info.num_kv_pages,
        info.block_size,
        f" in each of {cores} engine cores (data parallel)" if cores > 1 else "",
        parsers.tool_parser,
        parsers.reasoning_parser,
        config.max_tokens_policy,
        config.url,
    )
