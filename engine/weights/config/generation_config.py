"""The checkpoint's recommended sampling values (generation_config.json: temperature, top_p, top_k,
min_p, repetition_penalty), which apply to every request that leaves them out, as vLLM applies
them. Agents never send these fields, so without this a model card's values (Qwen3: temperature
0.6, top_k 20, top_p 0.95) would never be used.

`--generation-config` takes vLLM's values: `auto` reads the model's folder, `vllm` applies none (the
OpenAI defaults: temperature 1, no top_k), a folder reads that folder's generation_config.json."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from engine.errors import ConfigError

logger = logging.getLogger("fp4serve.engine")

FILE = "generation_config.json"
AUTO, NONE = "auto", "vllm"
# field -> (lowest, highest, whether the lowest is allowed), as SamplingParams checks a request's
_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "top_k": (-1, math.inf, True),
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, 2.0, False),
}
FIELDS = tuple(_RANGES)

SamplingDefaults = tuple[tuple[str, float], ...]  # (field, value) pairs, in FIELDS order


def generation_defaults(source: str, model_path: Path) -> SamplingDefaults:
    """The sampling defaults `--generation-config source` gives for the model at `model_path`,
    logged once. ConfigError for a folder without the file, or a value no request could send."""
    if source == NONE:
        logger.info(
            "generation config: none applied (--generation-config vllm): requests that leave out a sampling "
            "field get OpenAI's defaults"
        )
        return ()
    file = (model_path if source == AUTO else Path(source)) / FILE
    if not file.is_file():
        if source != AUTO:
            raise ConfigError(f"--generation-config: {file} does not exist")
        return ()
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{file}: cannot read it ({e.__class__.__name__}); --generation-config vllm ignores it"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: must be a JSON object; --generation-config vllm ignores it")
    defaults = tuple((name, _checked(raw[name], name, file)) for name in FIELDS if raw.get(name) is not None)
    if defaults:
        logger.info(
            "generation config: %s from %s apply to requests that leave them out (--generation-config vllm "
            "turns this off)",
            ", ".join(f"{k}={v:g}" for k, v in defaults),
            file,
        )
    return defaults


def _checked(value: object, name: str, file: Path) -> float:
    low, high, low_allowed = _RANGES[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and name == "top_k":
        ok = float(value).is_integer()  # type: ignore[arg-type]
    if not ok or not (low <= value <= high) or (value == low and not low_allowed):  # type: ignore[operator]
        raise ConfigError(
            f"{file}: {name} {value!r} is out of range for sampling; --generation-config vllm ignores the file"
        )
    return int(value) if name == "top_k" else float(value)  # type: ignore[arg-type]
