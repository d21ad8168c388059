"""What the model runner adds for a hybrid model (Qwen3.5/3.6): the state-slot pool, sized at
start-up (`--num-state-slots`), and the linear-attention backend (`--linear-attention-backend`),
chosen once with a plain `if`: fla-core's Triton kernels on CUDA when they import, else torch."""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.hybrid_backend import HybridBackend
from engine.linear_attention import LinearAttentionBackend, TorchLinearAttentionBackend
from engine.state_pool import StatePool

logger = logging.getLogger("fp4serve.runner")

_MIB = 1 << 20
_DEFAULT_GPU_STATE_FRACTION = 0.25


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
            logger.info("state slots: %d (not --max-num-seqs %d): the default pool takes at most %.0f%% of free "
                        "device memory; set --num-state-slots to choose", cap, num_slots,
                        100 * _DEFAULT_GPU_STATE_FRACTION)
            num_slots = cap
    pool = StatePool(cfg.hybrid, num_slots, device)
    logger.info("state slots: %d x %.2f MiB = %.2f MiB (conv + recurrent state of %d Gated DeltaNet layers, float32)",
                num_slots, per_slot / _MIB, pool.nbytes / _MIB, len(cfg.hybrid.linear_layers))
    return pool


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
    """"fla" or "torch" for `--linear-attention-backend`."""
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


def make_hybrid_backend(attention: AttentionBackend, pool: StatePool, config: EngineConfig,
                        device: torch.device) -> HybridBackend:
    choice = choose_linear_backend(config.linear_attention_backend, device)
    linear: LinearAttentionBackend
    if choice == "fla":
        from engine.linear_attention_fla import FlaLinearAttentionBackend

        linear = FlaLinearAttentionBackend(pool, device)
    else:
        linear = TorchLinearAttentionBackend(pool, device)
    return HybridBackend(attention, linear)
