"""Which attention backend a run uses (`--attention-backend auto|flashinfer|cpu|torch`), decided once
at start-up with a plain `if`, and the one place that builds it. FlashInfer is imported only when the
device is CUDA, so a CPU process never loads it; the CPU ops are compiled only when a CPU run asks."""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig

logger = logging.getLogger("fp4serve.attention")

BACKEND_NAMES = ("auto", "flashinfer", "cpu", "torch")
# The head dims FlashInfer's decode kernel and its SM90 (fa3) prefill instantiate; the bundle
# prebuilds exactly these.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


def flashinfer_import_error(device: torch.device) -> str | None:
    """Why FlashInfer cannot serve on `device`, or None when it imports there.

    NOTE: on a non-CUDA device this returns without importing flashinfer: its import probes
    the CUDA toolchain and may JIT-build a torch addon (docs/gpu.md)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA/JIT environment raising at import
        return f"import flashinfer failed ({type(e).__name__}: {e})"
    return None


def flashinfer_shape_error(dtype: torch.dtype | None, head_dim: int | None) -> str | None:
    """Why FlashInfer's kernels do not cover this model's dtype or head dim, or None."""
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (FlashInfer runs bfloat16 and float16)"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer kernels cover {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    return None


def choose_backend(
    name: str,
    device: torch.device,
    flashinfer_available: bool,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> str:
    """ "flashinfer", "cpu" or "torch" for the flag value `name`.

    auto: FlashInfer on CUDA when it imports and covers the model; on a CPU the paged-attention
    ops (compiled once per machine) when they build and cover the dtypes; else torch, with the
    reason logged. A backend asked for where it cannot run is the operator's mistake: a one-line
    ConfigError."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"--attention-backend: '{name}' is not one of {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return "torch"
    if device.type == "cpu" and name in ("auto", "cpu"):
        why_not = _cpu_ops_error(dtype, kv_dtype)
        if why_not is None:
            return "cpu"
        if name == "cpu":
            raise ConfigError(f"--attention-backend cpu: {why_not}; use auto or torch")
        logger.info("attention backend auto: torch, since the CPU paged-attention ops %s", why_not)
        return "torch"
    if name == "cpu":
        raise ConfigError(f"--attention-backend cpu: needs --device cpu, this run uses {device.type}")
    if device.type != "cuda":
        why = f"needs a CUDA device, this run uses {device.type}"
    elif not flashinfer_available:
        why = "flashinfer does not import here (install the GPU bundle, docs/gpu.md)"
    else:
        shape = flashinfer_shape_error(dtype, head_dim)
        why = f"does not cover {shape}" if shape else None
    if why is None:
        return "flashinfer"
    if name == "flashinfer":
        raise ConfigError(f"--attention-backend flashinfer: {why}; use auto or torch")
    # A GPU serving through the torch reference is slow: say so loudly. On CPU it is the design.
    log = logger.warning if device.type == "cuda" else logger.info
    log("attention backend auto: torch, since FlashInfer %s", why)
    return "torch"


def _cpu_ops_error(dtype: torch.dtype | None, kv_dtype: torch.dtype | None) -> str | None:
    """Why the CPU paged-attention ops cannot serve these dtypes, or None once they are loaded."""
    from engine.attention.cpu_paged import SUPPORTED_DTYPES
    from engine.host.cpu_kernels import load_cpu_ops

    if dtype is not None and (dtype, kv_dtype or dtype) not in SUPPORTED_DTYPES:
        names = (str(t).removeprefix("torch.") for t in (dtype, kv_dtype or dtype))
        activations, kv = names
        return f"do not cover {activations} activations with a {kv} KV cache"
    error = load_cpu_ops()
    return None if error is None else f"could not be built ({error})"


def make_backend(
    choice: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int
) -> AttentionBackend:
    """The backend `choose_backend` named, built for this model."""
    if choice == "flashinfer":
        from engine.attention.flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, dtype, device)
    if choice == "cpu":
        from engine.attention.cpu_paged import CpuAttentionBackend

        return CpuAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device)
    assert choice == "torch", f"unknown attention backend {choice!r}"
    from engine.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device)
