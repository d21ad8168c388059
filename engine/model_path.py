"""Where the weights come from: a local checkpoint folder, or the embedded demo model when no
--model is given (the server never downloads). Kept apart from engine/core.py so the core knows
nothing of the demo."""

from __future__ import annotations

from pathlib import Path

from engine.config import ConfigError, EngineConfig


def resolve_model_path(config: EngineConfig) -> tuple[Path, bool]:
    """(checkpoint folder, whether it is the embedded demo model)."""
    if config.model is None:
        from fp4serve_tools.demo import ensure_demo_model

        return ensure_demo_model(), True
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--model {config.model}: not a local folder (fp4serve never downloads weights)")
    return path, False


def default_model_name(path: Path, is_demo: bool) -> str:
    """The name /v1/models shows when --served-model-name is not given."""
    if is_demo:
        from fp4serve_tools.demo import DEMO_MODEL_NAME

        return DEMO_MODEL_NAME
    return path.name
