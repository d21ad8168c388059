"""The EngineConfig default a flag shows in --help and starts from, read from the dataclass so
the two never differ."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.front import EngineConfig


def engine_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)
