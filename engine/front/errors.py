"""Every engine error the HTTP side turns into a response, gathered for api/: each is defined
beside the code that raises it and re-exported here, so api/ names one module for all of them."""

from __future__ import annotations

from engine.errors import CONTEXT_LENGTH_EXCEEDED, ConfigError, ContextLengthError
from engine.front.admission import EngineOverloadedError
from engine.front.async_engine import EngineDeadError, EngineRestartingError
from scheduler.request import ParamError

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "ConfigError",
    "ContextLengthError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRestartingError",
    "ParamError",
]
