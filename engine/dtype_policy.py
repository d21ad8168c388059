"""Which dtype the model runs in when `--dtype auto`: the checkpoint's, except where the device
is measurably faster at another (docs/PERF.md "Weight formats on CPU" has the figures)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.quantization import INT8

logger = logging.getLogger("fp4serve.runner")

# Measured on SmolLM2-135M (docs/PERF.md): see resolve_dtype.
CPU_FLOAT32_AS_BF16 = True
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: without them torch emulates bf16 matmuls, slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """`name` is EngineConfig.dtype, `checkpoint_dtype` config.json's torch_dtype and `quantization`
    EngineConfig.quantization."""
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype, torch.float32)
    if device.type == "cuda":
        return torch.bfloat16 if dtype == torch.float32 else dtype  # a float32 checkpoint runs in bf16 on GPU
    if quantization == INT8:
        # `_weight_int8pack_mm` is fast with bf16 activations only (float32 ones: 10x slower and more).
        logger.info("dtype auto: int8 weights run with bfloat16 activations (the int8 kernel's fast path)")
        return torch.bfloat16
    if not cpu_has_native_bf16():
        if dtype != torch.float32:
            logger.info("dtype auto: this CPU has no AMX/AVX512-BF16, so %s runs as float32 (faster here)",
                        checkpoint_dtype)
        return torch.float32
    if dtype == torch.float32 and CPU_FLOAT32_AS_BF16:
        logger.info("dtype auto: float32 checkpoint runs as bfloat16 on this CPU (AMX/AVX512-BF16); "
                    "--dtype float32 keeps float32")
        return torch.bfloat16
    return dtype
