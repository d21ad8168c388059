"""Frozen configuration: `EngineConfig` (what the operator chose; CLI flags map one-to-one onto its
fields) and `parse_memory`, which reads its KV cache size. The checkpoint's own config is
engine/weights/config/model_config.py; the KV-events config, engine/cache_events/config.py."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from engine.cache_events.config import KVEventsConfig, offset_endpoint
from engine.errors import ConfigError

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """'2GiB' -> (bytes, None); '0.85' -> (None, fraction). Raises ConfigError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"--kv-cache-memory: cannot read '{text}' (use e.g. 4GiB, 512MB or 0.9)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b")
    if not unit and number <= 1.0 and "." in m.group(1):
        return None, number
    if unit not in _UNITS:
        raise ConfigError(f"--kv-cache-memory: unknown unit in '{text}'")
    return int(number * _UNITS[unit]), None


# Compiled grammars kept for reuse, in bytes of xgrammar's own accounting (engine/structured_output/grammar_cache.py):
# vLLM's default for xgrammar's cache (VLLM_XGRAMMAR_CACHE_MB).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20

# Most prefill tokens one request gets per step, so decodes and short prompts keep flowing while a
# long prompt prefills (docs/PERF.md "Fair team endpoint" has the measurement behind it).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 512


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = (
        None  # HF folder, .gguf file or built-in name (engine/weights/model_source.py); None: the default
    )
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    kv_cache_memory: str | None = None  # bytes ("2GiB") or a fraction of free device memory
    kv_offloading_size: float = 0.0  # GiB of host memory for evicted KV pages and state snapshots; 0: off
    block_size: int = 16
    kv_cache_dtype: str = (
        "auto"  # auto (the model dtype) | bfloat16 | float16 | float32 (engine/weights/dtype_policy.py)
    )
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | flashinfer | cpu | torch
    enforce_eager: bool = False  # decode without CUDA graphs
    # Schedule and prepare step n+1 while the device computes step n (vLLM's async scheduling);
    # None: on with CUDA, off on CPU (where the forward runs on the host thread itself).
    async_scheduling: bool | None = None
    device: str = "auto"  # auto | cpu | cuda
    # auto | none (or None) | nvfp4 | int8: quantize a float checkpoint at load (int8: CPU only);
    # auto: int8 for the built-in SmolLM2 on CPU, else none (engine/weights/dtype_policy.py)
    quantization: str | None = "auto"
    num_state_slots: int | None = None  # hybrid models: recurrent-state slots; None: max_num_seqs (GPU: capped)
    # Hybrid prefix caching: DeltaNet state checkpoints (None: sized from memory; 0: hybrid prefix
    # caching off), and the most spacing, as a fraction of the position, between the snapshots taken
    # inside a prefill (None: as dense as half the checkpoints allow; 0: none).
    num_state_checkpoints: int | None = None
    state_checkpoint_spacing: float | None = None
    linear_attention_backend: str = "auto"  # hybrid models: auto | torch | fla
    seed: int = 0
    engine_process: bool = True  # the engine core in a process of its own; False: a thread of the server's
    scheduling_policy: str = "fair"  # fair | fcfs | priority (scheduler/fair_queue.py)
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD  # 0: no per-request cap
    # Speculative decoding (engine/spec_decode/): None = off; else SpeculativeConfig's checks apply.
    speculative_method: str | None = None  # ngram | mtp
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_max_batch: int | None = None  # None: engine/spec_decode/config.py's measured default
    # Each request's draft length follows its acceptance (scheduler/scheduler.py next_draft_len);
    # None: on for CPU, where a rejected draft's row costs as much as an accepted one's, off on CUDA.
    speculative_adaptive: bool | None = None
    kv_events_config: KVEventsConfig | None = None  # None: no KV-cache events (engine/cache_events/kv_events.py)
    # mtp: take the MTP head (mtp.*) from this second checkpoint folder (FP8 or float) of the same model
    speculative_model: str | None = None
    # The engine process's supervisor, in the server's process (engine/client/supervisor.py).
    engine_step_timeout_s: float = 60.0  # a step making no progress this long is a hang; 0: no watchdog
    engine_start_timeout_s: float = 600.0  # most seconds an engine process may take to load; 0: no limit
    engine_max_restarts: int = 5  # lost engines replaced within the window; 0: a lost engine stops the server
    engine_restart_window_s: float = 600.0
    # Data parallel (engine/client/placement.py): engine cores behind the one server, each a process with its
    # own device (or CPUs) and KV cache; the rank is which of them a core is (set per core by for_rank).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Sampling defaults for fields a request leaves out: auto (the model's generation_config.json),
    # vllm (none), or a folder holding a generation_config.json (engine/weights/config/generation_config.py).
    generation_config: str = "auto"
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES  # compiled grammars kept (LRU); 0: none kept

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype: '{self.dtype}' is not one of auto, float32, bfloat16, float16")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(
                f"--kv-cache-dtype: '{self.kv_cache_dtype}' is not one of auto, bfloat16, float16, float32"
            )
        for flag, value in (
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--block-size", self.block_size),
        ):
            if value < 1:
                raise ConfigError(f"{flag}: must be positive, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len: must be at least 2, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "torch", "flashinfer", "cpu"):
            raise ConfigError(
                f"--attention-backend: '{self.attention_backend}' is not one of auto, flashinfer, cpu, torch"
            )
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if not 0.0 <= self.kv_offloading_size < float("inf"):
            raise ConfigError(
                f"--kv-offloading-size: must be a non-negative number of GiB, got {self.kv_offloading_size:g}"
            )
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError(f"--num-state-slots: must be positive, got {self.num_state_slots}")
        if self.num_state_checkpoints is not None and self.num_state_checkpoints < 0:
            raise ConfigError(f"--num-state-checkpoints: must not be negative, got {self.num_state_checkpoints}")
        if self.state_checkpoint_spacing is not None and not 0.0 <= self.state_checkpoint_spacing <= 1.0:
            raise ConfigError(f"--state-checkpoint-spacing: must be in [0, 1], got {self.state_checkpoint_spacing}")
        if self.scheduling_policy not in ("fair", "fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy: '{self.scheduling_policy}' is not one of fair, fcfs, priority")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"--long-prefill-token-threshold: must not be negative, got {self.long_prefill_token_threshold}"
            )
        if self.quantization not in (None, "auto", "none", "nvfp4", "int8", "int4"):
            raise ConfigError(f"--quantization: '{self.quantization}' is not one of auto, none, nvfp4, int8, int4")
        if self.speculative_model is not None and self.speculative_method != "mtp":
            raise ConfigError(
                f"--speculative-model: takes the MTP head of another checkpoint, so it needs "
                f"--speculative-method mtp, not {self.speculative_method}"
            )
        if self.grammar_cache_bytes < 0:
            raise ConfigError(f"--grammar-cache-bytes: must not be negative, got {self.grammar_cache_bytes}")
        if self.linear_attention_backend not in ("auto", "torch", "fla"):
            raise ConfigError(
                f"--linear-attention-backend: '{self.linear_attention_backend}' is not one of auto, torch, fla"
            )
        for flag, value in (
            ("--engine-step-timeout", self.engine_step_timeout_s),
            ("--engine-start-timeout", self.engine_start_timeout_s),
            ("--engine-max-restarts", self.engine_max_restarts),
        ):
            if value < 0:
                raise ConfigError(f"{flag}: must not be negative, got {value:g}")
        if self.engine_restart_window_s <= 0:
            raise ConfigError(f"--engine-restart-window: must be positive, got {self.engine_restart_window_s:g}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size: must be positive, got {self.data_parallel_size}")
        assert 0 <= self.data_parallel_rank < self.data_parallel_size, (
            f"data-parallel rank {self.data_parallel_rank} of {self.data_parallel_size}"
        )
        events = self.kv_events_config
        if self.data_parallel_size > 1 and events is not None and events.enabled:
            sockets = [
                e
                for rank in range(self.data_parallel_size)
                for e in (
                    offset_endpoint(events.endpoint, rank),
                    offset_endpoint(events.replay_endpoint, rank) if events.replay_endpoint else None,
                )
                if e
            ]
            if len(set(sockets)) < len(sockets):
                raise ConfigError(
                    f"--kv-events-config: with --data-parallel-size {self.data_parallel_size} each "
                    f"engine core publishes on the endpoint's port + its rank (and replays on the "
                    f"replay port + its rank), so two of them would share a socket "
                    f"({', '.join(sockets)}); leave room between the two ports"
                )

    def for_rank(self, rank: int) -> EngineConfig:
        """The config of engine core `rank` of data_parallel_size: the same, with its KV events on
        their own port (KVEventsConfig.for_rank)."""
        events = self.kv_events_config.for_rank(rank) if self.kv_events_config is not None else None
        return dataclasses.replace(self, data_parallel_rank=rank, kv_events_config=events)
