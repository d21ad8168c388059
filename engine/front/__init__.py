"""The engine's front, in the server's process: AsyncEngine, the input and output processors, the
tokenizer and detokenizer, admission, the metrics and the offline driver. Text lives here;
the core below speaks token ids.

This package is also the one seam api/ imports the engine through (with engine.front.errors for
the errors it maps to responses; tests/test_layering.py holds api/ to the two): the boundary
types below. NOTE: the API process must not import torch, so names whose modules are heavy
(the model, grammars, the tokenizer) load on first use, through `__getattr__`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.cache_events.config import KVEventsConfig
from engine.config import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD, EngineConfig, parse_memory
from engine.core_types import Owner
from engine.front.admission import QueueLimits
from engine.front.outputs import RequestOutput, TokenLogprob
from scheduler.request import SamplingParams
from scheduler.structured_output import (
    THINK,
    Reasoning,
    StructuredOutput,
    ThinkTags,
    ToolSpec,
    XmlParam,
    XmlValueKind,
    canonical_json,
)

if TYPE_CHECKING:
    from engine.front.async_engine import MAX_CONSECUTIVE_FAILURES, AsyncEngine
    from engine.front.input_processor import MAX_TOKENS_POLICIES, InputProcessor, MaxTokensPolicy
    from engine.front.metrics import KeyUsage
    from engine.spec_decode.config import speculative_config_fields
    from engine.structured_output.manager import StructuredOutputs

# name -> the module that defines it, imported on first use
_LAZY = {
    "AsyncEngine": "engine.front.async_engine",
    "MAX_CONSECUTIVE_FAILURES": "engine.front.async_engine",
    "InputProcessor": "engine.front.input_processor",
    "MAX_TOKENS_POLICIES": "engine.front.input_processor",
    "MaxTokensPolicy": "engine.front.input_processor",
    "KeyUsage": "engine.front.metrics",
    "speculative_config_fields": "engine.spec_decode.config",
    "StructuredOutputs": "engine.structured_output.manager",
}

__all__ = [
    "DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD",
    "THINK",
    "EngineConfig",
    "KVEventsConfig",
    "Owner",
    "QueueLimits",
    "Reasoning",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "ThinkTags",
    "TokenLogprob",
    "ToolSpec",
    "XmlParam",
    "XmlValueKind",
    "canonical_json",
    "parse_memory",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
