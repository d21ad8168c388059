"""Which dtype and weight format the model runs in under `--dtype auto` / `--quantization auto`:
the checkpoint's, except where the device is measurably faster at another for a measured, small
quality cost (docs/PERF.md "Weight formats and dtype on CPU" has the figures)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.model_source import DEFAULT_MODEL_NAME, default_model
from engine.quantization import INT8

logger = logging.getLogger("fp4serve.runner")

# --quantization auto's int8 keeps a dense bf16 copy of the dequantized weights for inputs of this
# many rows or more, where the float GEMM beats torch's int8 matrix-vector kernel (measured
# crossover 14-16 rows on SmolLM2's shapes: Int8Linear.keep_dense_copy, docs/PERF.md).
AUTO_INT8_DENSE_FROM_ROWS = 16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: without them torch emulates bf16 matmuls, slower than float32."""
    try:
        flags = CPUINFO.read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """`name` is EngineConfig.dtype, `checkpoint_dtype` config.json's torch_dtype and `quantization`
    EngineConfig.quantization.

    On a CPU with native bf16 every float checkpoint runs as bf16, as vLLM's CPU backend does: on
    SmolLM2-135M it cut the linears' time 2.4x at batch 1 for a perplexity 0.14% higher (float16
    is slower still than float32 at batch 32). Without native bf16, float32 is the fast one."""
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype, torch.float32)
    if device.type == "cuda":
        return torch.bfloat16 if dtype == torch.float32 else dtype  # a float32 checkpoint runs in bf16 on GPU
    if quantization == INT8:
        # `_weight_int8pack_mm` is fast with bf16 activations only (float32 ones: 10x slower and more,
        # also with torch's AVX2 kernels).
        logger.info("dtype auto: int8 weights run with bfloat16 activations (the int8 kernel's fast path)")
        return torch.bfloat16
    if not cpu_has_native_bf16():
        if dtype != torch.float32:
            logger.info("dtype auto: this CPU has no AMX/AVX512-BF16, so %s runs as float32 (faster here)",
                        checkpoint_dtype)
        return torch.float32
    if dtype != torch.bfloat16:
        logger.info("dtype auto: this CPU has AMX/AVX512-BF16, so the %s checkpoint runs as bfloat16 (faster "
                    "here; --dtype %s keeps it)", checkpoint_dtype, checkpoint_dtype)
    return torch.bfloat16


def resolve_quantization(requested: str | None, model: str | None, device: torch.device,
                         dtype: str = "auto") -> str | None:
    """EngineConfig.quantization -> the scheme quantized at load (None: the checkpoint as it is);
    `model` and `dtype` are EngineConfig's.

    auto: the built-in SmolLM2 runs int8 on a CPU (unless --dtype asks for float32 or float16
    activations, with which the int8 kernel is slow). Its weights come from a Q4_1 GGUF, so the
    float copy holds little that int8 per channel loses (perplexity +0.55%, top-1 agreement 96.6%
    with float32), and int8 has the fastest step measured. Any other checkpoint runs as it is."""
    if requested in (None, "none"):
        return None
    if requested != "auto":
        if requested == INT8 and dtype in ("float32", "float16"):
            logger.warning("--quantization int8 with --dtype %s: torch's int8 kernel is 10x slower and more with "
                           "%s activations than with bfloat16 ones (--dtype auto)", dtype, dtype)
        return requested
    if device.type == "cpu" and dtype in ("auto", "bfloat16") and (model or default_model()) == DEFAULT_MODEL_NAME:
        logger.info("quantization auto: the built-in %s (from a Q4_1 GGUF) runs int8 on CPU; "
                    "--quantization none keeps it float", DEFAULT_MODEL_NAME)
        return INT8
    return None


def int8_dense_from_rows(requested: str | None, scheme: str | None) -> int:
    """The row count from which int8 linears use their dense copy: only when `--quantization auto`
    chose int8 (it trades memory for speed on a small built-in model); 0 (no copy) otherwise, so an
    explicit --quantization int8 keeps int8's memory saving."""
    return AUTO_INT8_DENSE_FROM_ROWS if requested == "auto" and scheme == INT8 else 0
