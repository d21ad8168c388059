"""What `--speculative-method` and its companions ask for, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError

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
            raise ConfigError(f"--ngram-min / --ngram-max: need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")
        if self.max_batch < 1:
            raise ConfigError(f"--speculative-max-batch: must be positive, got {self.max_batch}")
