"""Where the weights come from: what `--model` names (engine/weights/model_source.py: a local folder, a
.gguf file, SmolLM2 by default), or the embedded demo model (`fp4serve-demo-qwen3`, built once by
engine/weights/demo_model.py); the server never downloads. Kept apart from engine/core.py so the core knows
nothing of the demo."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.weights.model_source import DEMO_MODEL_KEYWORD, default_model, model_name, resolve_model


def resolve_model_path(config: EngineConfig) -> tuple[Path, bool]:
    """(checkpoint folder, whether it is the embedded demo model); a GGUF file is converted once
    into the cache."""
    model = config.model or default_model()
    if model == DEMO_MODEL_KEYWORD:
        from engine.weights.demo_model import ensure_demo_model

        return ensure_demo_model(), True
    return resolve_model(model), False


def default_model_name(config: EngineConfig) -> str:
    """The name /v1/models shows when --served-model-name is not given."""
    return model_name(config.model)
