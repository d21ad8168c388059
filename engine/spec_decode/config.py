"""What `--speculative-method` and its companions ask for, checked once; vLLM's
`--speculative-config` JSON read into the same fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

METHODS = ("ngram", "mtp")
# Above this many running sequences the scheduler drafts nothing: verifying K more rows per request
# costs more than the accepted tokens save once a step is compute bound. Taken from
# `python -m bench.spec_decode` on the code-edit workload (docs/PERF.md, "Speculative decoding"):
# on the 2-core CPU reference n-gram still gained at every measured concurrency up to 32 (1.28x at
# 1, 1.32x at 8, 1.46x at 16), so the cut sits at the largest size measured. NOTE: the GPU
# crossover is unmeasured; expect it lower, and set --speculative-max-batch from a measurement.
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "mtp"
    num_speculative_tokens: int = 4  # K: most draft tokens per request per step
    ngram_min: int = 2  # shortest suffix n-gram looked up in the context
    ngram_max: int = 4  # longest; tried first
    max_batch: int = DEFAULT_MAX_BATCH  # draft only while at most this many sequences run

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative-method: '{self.method}' is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"--num-speculative-tokens: must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"--ngram-min / --ngram-max: need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.max_batch < 1:
            raise ConfigError(f"--speculative-max-batch: must be positive, got {self.max_batch}")


# vLLM's `--speculative-config` JSON keys -> EngineConfig fields (the ones fp4serve has).
_VLLM_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "model": "speculative_model",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "disable_by_batch_size": "speculative_max_batch",
}
# vLLM's method names for a Qwen3.5/3.6 (and Qwen3-Next) MTP head; vLLM maps them onto "mtp" too.
_MTP_ALIASES = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")


def speculative_config_fields(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config '{"method": "mtp", "num_speculative_tokens": 3, "model": PATH}'`
    as EngineConfig field values. Raises ConfigError (one line) for what it cannot express."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError("--speculative-config: must be a JSON object")
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "draft_tensor_parallel_size" and value in (None, 1):
            continue  # one device: the only size there is
        if key not in _VLLM_KEYS:
            raise ConfigError(f"--speculative-config: unsupported key '{key}'; supported: {', '.join(_VLLM_KEYS)}")
        if key == "method" and value in _MTP_ALIASES:
            value = "mtp"
        fields[_VLLM_KEYS[key]] = value
    for field in ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative_max_batch"):
        value = fields.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            key = next(k for k, f in _VLLM_KEYS.items() if f == field)
            raise ConfigError(f"--speculative-config: '{key}' must be an integer, got {value!r}")
    if fields.get("speculative_model") is not None and fields.get("speculative_method") is None:
        fields["speculative_method"] = "mtp"  # a second checkpoint drafts only through its MTP head here
    return fields
