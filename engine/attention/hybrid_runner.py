"""What the model runner adds for a hybrid model (Qwen3.5/3.6): the state-slot pool, sized at
start-up (`--num-state-slots`), the state-checkpoint pool of prefix caching
(`--num-state-checkpoints`, `--state-checkpoint-spacing`), and the linear-attention backend
(`--linear-attention-backend`), chosen once with a plain `if`: fla-core's Triton kernels on CUDA
when they import, else torch."""

from __future__ import annotations

import logging
import math

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.hybrid_backend import HybridBackend
from engine.attention.linear_attention import LinearAttentionBackend, TorchLinearAttentionBackend
from engine.attention.state_pool import StatePool
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig
from scheduler.checkpoint_manager import MAX_GRID_BITS, grid_bits_for

logger = logging.getLogger("fp4serve.runner")

_MIB = 1 << 20
_DEFAULT_GPU_STATE_FRACTION = 0.25
# Checkpoints by default: on a GPU a fifth of the memory free after the weights and slots (before
# the KV pages: a 27B hybrid's KV needs little); on CPU this many bytes, at most one per KV page.
_DEFAULT_GPU_CHECKPOINT_FRACTION = 0.2
_DEFAULT_CPU_CHECKPOINT_BYTES = 256 << 20


def make_state_pool(cfg: ModelConfig, config: EngineConfig, device: torch.device) -> StatePool | None:
    """The pool of recurrent-state slots, or None for a model without DeltaNet layers."""
    if cfg.hybrid is None:
        return None
    per_slot = cfg.hybrid.state_bytes_per_slot()
    num_slots = config.num_state_slots or config.max_num_seqs
    if config.num_state_slots is None and device.type == "cuda":
        # A Qwen3.6-27B slot is ~150 MiB: by default the pool takes at most a quarter of free memory.
        free, _ = torch.cuda.mem_get_info(device)
        cap = max(1, int(free * _DEFAULT_GPU_STATE_FRACTION) // per_slot)
        if cap < num_slots:
            logger.info(
                "state slots: %d (not --max-num-seqs %d): the default pool takes at most %.0f%% of free "
                "device memory; set --num-state-slots to choose",
                cap,
                num_slots,
                100 * _DEFAULT_GPU_STATE_FRACTION,
            )
            num_slots = cap
    pool = StatePool(cfg.hybrid, num_slots, device)
    logger.info(
        "state slots: %d x %.2f MiB = %.2f MiB (conv + recurrent state of %d Gated DeltaNet layers, float32)",
        num_slots,
        per_slot / _MIB,
        pool.nbytes / _MIB,
        len(cfg.hybrid.linear_layers),
    )
    return pool


def make_checkpoint_pool(
    cfg: ModelConfig,
    config: EngineConfig,
    device: torch.device,
    kv_page_shape: tuple[int, ...],
    num_kv_layers: int,
    kv_dtype: torch.dtype,
    num_kv_pages: int | None,
    max_model_len: int,
) -> tuple[CheckpointPool | None, int]:
    """The checkpoint pool of hybrid prefix caching (None: off) and its snapshot grid's bits
    (scheduler/checkpoint_manager.py `on_grid`). `num_kv_pages`: known on CPU, caps the default."""
    if cfg.hybrid is None or not config.enable_prefix_caching or config.num_state_checkpoints == 0:
        return None, 0
    page_bytes = math.prod(kv_page_shape) * torch.tensor([], dtype=kv_dtype).element_size()
    per_checkpoint = cfg.hybrid.state_bytes_per_slot() + num_kv_layers * page_bytes
    num = config.num_state_checkpoints
    if num is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            num = max(1, int(free * _DEFAULT_GPU_CHECKPOINT_FRACTION) // per_checkpoint)
        else:
            num = max(4, _DEFAULT_CPU_CHECKPOINT_BYTES // per_checkpoint)
            num = min(num, num_kv_pages) if num_kv_pages else num
    pool = CheckpointPool(cfg.hybrid, num, kv_page_shape, num_kv_layers, kv_dtype, device)
    spacing = config.state_checkpoint_spacing
    max_pages = -(-max_model_len // config.block_size)
    # Auto: the densest grid whose snapshots of one max_model_len context take at most half the pool
    # (they are evicted before any prompt end or sequence end, scheduler/checkpoint_manager.py).
    bits = grid_bits_for(max_pages, num // 2) if spacing is None else spacing_bits(spacing)
    grid = (
        f"page counts with at most {bits} significant bits (spacing <= {2.0 ** (1 - bits):.3g} of the position)"
        if bits
        else "none"
    )
    logger.info(
        "hybrid prefix caching on: %d state checkpoints x %.2f MiB = %.2f MiB (the DeltaNet state of %d "
        "layers, float32, plus one KV page of %d attention layers); snapshots at prompt ends, sequence ends, "
        "shared-prefix junctions and inside prefills at %s",
        num,
        pool.bytes_per_checkpoint / _MIB,
        pool.nbytes / _MIB,
        len(cfg.hybrid.linear_layers),
        num_kv_layers,
        grid,
    )
    return pool, bits


def spacing_bits(spacing: float) -> int:
    """--state-checkpoint-spacing F as grid bits: the fewest whose spacing 2^(1 - bits) is <= F."""
    if spacing <= 0:
        return 0
    return min(MAX_GRID_BITS, 1 + max(0, math.ceil(-math.log2(spacing))))


def fla_import_error(device: torch.device) -> str | None:
    """Why fla-core's kernels cannot run on `device`, or None. Imported only on CUDA."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # ImportError, or Triton failing to initialise
        return f"import fla failed ({type(e).__name__}: {e})"
    return None


def choose_linear_backend(name: str, device: torch.device) -> str:
    """ "fla" or "torch" for `--linear-attention-backend`."""
    if name == "torch":
        return "torch"
    why = fla_import_error(device)
    if why is None:
        return "fla"
    if name == "fla":
        raise ConfigError(f"--linear-attention-backend fla: {why}; install the gpu extra (fla-core) or use torch")
    log = logger.warning if device.type == "cuda" else logger.info
    log("linear attention backend auto: torch, since fla-core cannot run (%s)", why)
    return "torch"


def make_hybrid_backend(
    attention: AttentionBackend,
    pool: StatePool,
    config: EngineConfig,
    device: torch.device,
    checkpoints: CheckpointPool | None = None,
) -> HybridBackend:
    choice = choose_linear_backend(config.linear_attention_backend, device)
    linear: LinearAttentionBackend
    if choice == "fla":
        from engine.attention.linear_attention_fla import FlaLinearAttentionBackend

        linear = FlaLinearAttentionBackend(pool, device, checkpoints=checkpoints)
    else:
        linear = TorchLinearAttentionBackend(pool, device, checkpoints=checkpoints)
    return HybridBackend(attention, linear)
