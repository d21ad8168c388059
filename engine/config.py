"""Frozen configuration: `ModelConfig` (read from a checkpoint's config.json) and
`EngineConfig` (what the operator chose; CLI flags map one-to-one onto its fields)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.weights.hybrid_config import (
    HYBRID_ARCHITECTURES,
    HYBRID_MOE_ARCHITECTURES,
    HybridConfig,
    hybrid_from_dict,
    text_fields,
)
from engine.weights.moe_config import MoeConfig, moe_config_from_dict

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    **{arch: "qwen3_5" for arch in HYBRID_ARCHITECTURES},
    "Qwen3MoeForCausalLM": "qwen3_moe",
    **{arch: "qwen3_5_moe" for arch in HYBRID_MOE_ARCHITECTURES},
}
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# our model_type -> the MoE config's model_type (Qwen3.5-MoE's text config: qwen3_5_moe_text)
_MOE_CONFIG_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str  # "qwen3" | "llama" | "qwen3_5" | "qwen3_moe" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str  # as written in the checkpoint: "bfloat16", "float32", ...
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization: dict[str, Any] | None = None  # the checkpoint's quantization config, if any
    hybrid: HybridConfig | None = None  # Qwen3.5/3.6: Gated DeltaNet layers beside gated attention
    moe: MoeConfig | None = None  # mixture-of-experts models: experts, top-k, which layers are sparse

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged KV cache (a hybrid model's DeltaNet layers keep state slots instead)."""
        return len(self.hybrid.attention_layers) if self.hybrid is not None else self.num_layers

    @property
    def rotary_dim(self) -> int:
        """The leading part of head_dim that RoPE rotates (all of it, except with partial RoPE)."""
        return int(self.head_dim * self.hybrid.partial_rotary_factor) if self.hybrid is not None else self.head_dim

    @staticmethod
    def from_checkpoint(path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found (a model folder needs config.json)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file}: invalid JSON ({e})") from None
        return ModelConfig.from_dict(raw, source=str(cfg_file), folder=path)

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json", folder: Path | None = None) -> ModelConfig:
        def need(key: str, kind: type = int) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: missing field '{key}'")
            value = raw[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{source}: field '{key}' must be an integer, got {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: field '{key}' must be a number, got {value!r}")
            return value

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or '(none given)'} in field 'architectures'; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        hybrid = None
        if model_type in HYBRID_MODEL_TYPES:
            has_vision = isinstance(raw.get("vision_config"), dict)
            raw = text_fields(raw)
            hybrid = dataclasses.replace(hybrid_from_dict(raw, source), has_vision=has_vision)
        hidden = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        head_dim = raw.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"{source}: field 'num_key_value_heads' ({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        if folder is not None:
            eos_ids = _merge_generation_eos(folder, eos_ids)
        try:
            moe = moe_config_from_dict(raw, _MOE_CONFIG_TYPE.get(model_type, model_type), source)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=_dense_width(raw, moe, need),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("rms_norm_eps", float)),
            max_position_embeddings=raw.get("max_position_embeddings") or 4096,
            rope=_rope_config(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            quantization=raw.get("quantization_config"),
            hybrid=hybrid,
            moe=moe,
        )


def _dense_width(raw: dict[str, Any], moe: MoeConfig | None, need: Any) -> int:
    """The dense MLP width. Qwen3.5-MoE has no dense MLP (every layer is sparse) and no
    `intermediate_size`: its one dense SwiGLU is the shared expert, so that width stands in."""
    if raw.get("intermediate_size") is None and moe is not None and moe.shared_expert_intermediate_size:
        return moe.shared_expert_intermediate_size
    return need("intermediate_size")


def _merge_generation_eos(folder: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json often lists more EOS ids than config.json (Llama 3 chat)."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return eos_ids
    try:
        value = json.loads(gen.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return eos_ids
    extra = value if isinstance(value, list) else ([value] if isinstance(value, int) else [])
    return tuple(dict.fromkeys([*eos_ids, *extra]))


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older, `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"{source}: unsupported rope type '{rope_type}' in field 'rope_scaling'")
    if rope_type != "default" and "factor" not in merged:
        raise ConfigError(f"{source}: rope type '{rope_type}' needs 'factor' in field 'rope_scaling'")
    fields = {k: merged[k] for k in RopeConfig.__dataclass_fields__ if k in merged and k not in ("theta", "rope_type")}
    if rope_type == "default":
        fields.pop("factor", None)
    return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


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
    model: str | None = None  # HF folder, .gguf file or built-in name (engine/weights/model_source.py); None: the default
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    kv_cache_memory: str | None = None  # bytes ("2GiB") or a fraction of free device memory
    kv_offloading_size: float = 0.0  # GiB of host memory for evicted KV pages and state snapshots; 0: off
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | bfloat16 | float16 | float32 (engine/weights/dtype_policy.py)
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
    # vllm (none), or a folder holding a generation_config.json (engine/weights/generation_config.py).
    generation_config: str = "auto"
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES  # compiled grammars kept (LRU); 0: none kept

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype: '{self.dtype}' is not one of auto, float32, bfloat16, float16")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"--kv-cache-dtype: '{self.kv_cache_dtype}' is not one of auto, bfloat16, float16, float32")
        if self.block_size < 1:
            raise ConfigError(f"--block-size: must be positive, got {self.block_size}")
        if self.attention_backend not in ("auto", "torch", "flashinfer", "cpu"):
            raise ConfigError(f"--attention-backend: '{self.attention_backend}' is not one of auto, flashinfer, cpu, torch")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if not 0.0 <= self.kv_offloading_size < float("inf"):
            raise ConfigError(f"--kv-offloading-size: must be a non-negative number of GiB, got {self.kv_offloading_size:g}")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError(f"--num-state-slots: must be positive, got {self.num_state_slots}")
        if self.num_state_checkpoints is not None and self.num_state_checkpoints < 0:
            raise ConfigError(f"--num-state-checkpoints: must not be negative, got {self.num_state_checkpoints}")
        if self.state_checkpoint_spacing is not None and not 0.0 <= self.state_checkpoint_spacing <= 1.0:
            raise ConfigError(f"--state-checkpoint-spacing: must be in [0, 1], got {self.state_checkpoint_spacing}")
        if self.scheduling_policy not in ("fair", "fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy: '{self.scheduling_policy}' is not one of fair, fcfs, priority")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold: must not be negative, got {self.long_prefill_token_threshold}")
        if self.quantization not in (None, "auto", "none", "nvfp4", "int8", "int4"):
            raise ConfigError(f"--quantization: '{self.quantization}' is not one of auto, none, nvfp4, int8, int4")
        if self.speculative_model is not None and self.speculative_method != "mtp":
            raise ConfigError(f"--speculative-model: takes the MTP head of another checkpoint, so it needs "
                              f"--speculative-method mtp, not {self.speculative_method}")
        if self.grammar_cache_bytes < 0:
            raise ConfigError(f"--grammar-cache-bytes: must not be negative, got {self.grammar_cache_bytes}")
        if self.linear_attention_backend not in ("auto", "torch", "fla"):
            raise ConfigError(f"--linear-attention-backend: '{self.linear_attention_backend}' is not one of auto, torch, fla")
        for flag, value in (("--engine-step-timeout", self.engine_step_timeout_s),
                            ("--engine-start-timeout", self.engine_start_timeout_s),
                            ("--engine-max-restarts", self.engine_max_restarts)):
            if value < 0:
                raise ConfigError(f"{flag}: must not be negative, got {value:g}")
        if self.engine_restart_window_s <= 0:
            raise ConfigError(f"--engine-restart-window: must be positive, got {self.engine_restart_window_s:g}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size: must be positive, got {self.data_parallel_size}")
        assert 0 <= self.data_parallel_rank < self.data_parallel_size, \
            f"data-parallel rank {self.data_parallel_rank} of {self.data_parallel_size}"
        events = self.kv_events_config
        if self.data_parallel_size > 1 and events is not None and events.enabled:
            sockets = [e for rank in range(self.data_parallel_size) for e in (
                offset_endpoint(events.endpoint, rank),
                offset_endpoint(events.replay_endpoint, rank) if events.replay_endpoint else None) if e]
            if len(set(sockets)) < len(sockets):
                raise ConfigError(f"--kv-events-config: with --data-parallel-size {self.data_parallel_size} each "
                                  f"engine core publishes on the endpoint's port + its rank (and replays on the "
                                  f"replay port + its rank), so two of them would share a socket "
                                  f"({', '.join(sockets)}); leave room between the two ports")

    def for_rank(self, rank: int) -> EngineConfig:
        """The config of engine core `rank` of data_parallel_size: the same, with its KV events on
        their own port (KVEventsConfig.for_rank)."""
        events = self.kv_events_config.for_rank(rank) if self.kv_events_config is not None else None
        return dataclasses.replace(self, data_parallel_rank=rank, kv_events_config=events)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A ZMQ endpoint moved to data-parallel rank `rank` (KVEventsConfig.for_rank)."""
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"--kv-events-config: {endpoint} has no port to offset by the data-parallel rank")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its `KVEventsConfig` fields and defaults): KV-cache events
    published over ZMQ for routers that track what each replica caches (engine/cache_events/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: "zmq" when enabled, as vLLM derives it
    endpoint: str = "tcp://*:5557"  # bound when it holds "*", "::", ipc:// or inproc://, else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher '{self.publisher}' is not one of zmq, null")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--kv-events-config: {name} must be positive, got {getattr(self, name)}")
        if self.hwm < 0:
            raise ConfigError(f"--kv-events-config: hwm must not be negative, got {self.hwm}")

    @property
    def enabled(self) -> bool:
        """Events are recorded and sent: enabled, and a real publisher (vLLM's "null" sends nothing)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel core `rank`'s sockets, as vLLM offsets them (its ZmqEventPublisher's
        offset_endpoint_port): a tcp port plus the rank, any other endpoint with `_dp<rank>` after
        it; rank 0 unchanged. The replay endpoint moves the same way."""
        if rank == 0:
            return self
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank),
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, rank)
                                   if self.replay_endpoint else None)

    @staticmethod
    def from_json(text: str) -> KVEventsConfig:
        """The flag's JSON object; unknown fields and wrong types are a ConfigError naming the field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config: invalid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config: expected a JSON object")
        fields = [f.name for f in dataclasses.fields(KVEventsConfig)]
        kinds = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}
        for key, value in raw.items():
            if key not in fields:
                raise ConfigError(f"--kv-events-config: unknown field '{key}'; known: {', '.join(fields)}")
            kind = kinds.get(key, str)
            if value is None and key in ("publisher", "replay_endpoint"):
                continue
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"--kv-events-config: field '{key}' must be {kind.__name__}, got {value!r}")
        return KVEventsConfig(**raw)
