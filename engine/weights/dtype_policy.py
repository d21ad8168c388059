"""Which dtype and weight format the model runs in under `--dtype auto` / `--quantization auto`:
the checkpoint's, except where the device is measurably faster at another for a measured, small
quality cost (docs/PERF.md "Weight formats and dtype on CPU" has the figures); the built-in model's
CPU format by a timing taken on the CPU at hand (engine/host/format_timing.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.host.format_timing import DENSE, FEW_ROWS, FormatTimer, LinearShapes, measured_formats, time_formats
from engine.weights.formats.nvfp4 import INT4, INT8
from engine.weights.model_source import DEFAULT_MODEL_NAME, default_model

logger = logging.getLogger("fp4serve.runner")

# --quantization auto's int8 keeps a dense copy of the dequantized weights for inputs of this
# many rows or more, where a GEMM beats torch's int8 matrix-vector kernel (measured crossover
# 14-16 rows on SmolLM2's shapes: Int8Linear.keep_dense_copy, docs/PERF.md).
AUTO_INT8_DENSE_FROM_ROWS = 16
# The same for auto's int4, by the CPU's bf16 support (docs/PERF.md "Weight formats, issue 30"):
# with native bf16 the oneDNN-packed bf16 GEMM catches up with the int4 kernel at 8 rows; without
# it the dense copy is float32 and the crossover lies between 16 and 32 rows (AVX2 kernels forced).
AUTO_INT4_DENSE_FROM_ROWS = 9
AUTO_INT4_DENSE_FROM_ROWS_NO_BF16 = 16

# What auto may choose for the built-in model, in order of preference on a tie (DENSE: its float weights).
AUTO_CANDIDATES = (INT4, INT8, DENSE)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: without them torch emulates bf16 matmuls, slower than float32."""
    try:
        flags = CPUINFO.read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(
    name: str, checkpoint_dtype: str, device: torch.device, quantization: str | None = None
) -> torch.dtype:
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
    if quantization in (INT8, INT4):
        # `_weight_int8pack_mm` is fast with bf16 activations only (float32 ones: 10x slower and more,
        # also with torch's AVX2 kernels); the int4 kernel is run with bf16 ones only.
        logger.info("dtype auto: %s weights run with bfloat16 activations (the kernel's fast path)", quantization)
        return torch.bfloat16
    if not cpu_has_native_bf16():
        if dtype != torch.float32:
            logger.info(
                "dtype auto: this CPU has no AMX/AVX512-BF16, so %s runs as float32 (faster here)", checkpoint_dtype
            )
        return torch.float32
    if dtype != torch.bfloat16:
        logger.info(
            "dtype auto: this CPU has AMX/AVX512-BF16, so the %s checkpoint runs as bfloat16 (faster "
            "here; --dtype %s keeps it)",
            checkpoint_dtype,
            checkpoint_dtype,
        )
    return torch.bfloat16


def int4_kernel_is_fast() -> bool:
    """torch runs its int4 CPU kernel with AVX512 code where the CPU has it. With ATen's AVX2
    kernels (ATEN_CPU_CAPABILITY=avx2 on the AVX512 EPYC) the int4 layers of SmolLM2 took 2.5-3x
    longer at one row than int8's, and no less than float32's (docs/PERF.md, issue 30)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the KV cache's dtype; auto: the model's `dtype`.

    On a CPU any of the float dtypes: K/V are cast as they are written and read (a bf16 cache with
    float32 activations halves the cache's bytes and its reads for bf16's rounding of K and V). On
    a GPU the attention kernels read the model's dtype only."""
    if name == "auto":
        return dtype
    kv_dtype = DTYPES[name]
    if device.type != "cpu" and kv_dtype != dtype:
        raise ConfigError(
            f"--kv-cache-dtype {name}: on {device.type} the KV cache holds the model dtype "
            f"({str(dtype).removeprefix('torch.')}); use auto"
        )
    if kv_dtype != dtype:
        logger.info(
            "kv cache dtype: %s (the model runs %s; K/V are cast as they are written and read)",
            name,
            str(dtype).removeprefix("torch."),
        )
    return kv_dtype


def resolve_quantization(
    requested: str | None,
    model: str | None,
    device: torch.device,
    dtype: str = "auto",
    shapes: LinearShapes | None = None,
    timer: FormatTimer = time_formats,
) -> str | None:
    """EngineConfig.quantization -> the scheme quantized at load (None: the checkpoint as it is);
    `model` and `dtype` are EngineConfig's, `shapes` the model's linears (LinearShapes.of).

    auto: the built-in SmolLM2 on a CPU (unless --dtype asks for float32 or float16 activations)
    runs whichever of int4, int8 and its float weights ran a decode step's linears fastest at one
    row on this CPU, as measured at start-up (engine/host/format_timing.py, `timer`) and cached for
    later starts. All three keep its quality: its weights come from a Q4_1 GGUF, int4 in groups of
    32 finds that same grid again (perplexity +0.21% against float32), int8 per channel +0.55%.
    Without `shapes` (no model at hand) the CPU's flags decide: int4 with AVX512, else int8. Any
    other checkpoint runs as it is; an explicit scheme is never overridden."""
    if requested in (None, "none"):
        return None
    if requested != "auto":
        if requested == INT8 and dtype in ("float32", "float16"):
            logger.warning(
                "--quantization int8 with --dtype %s: torch's int8 kernel is 10x slower and more with "
                "%s activations than with bfloat16 ones (--dtype auto)",
                dtype,
                dtype,
            )
        return requested
    if device.type != "cpu" or dtype not in ("auto", "bfloat16") or (model or default_model()) != DEFAULT_MODEL_NAME:
        return None
    if shapes is not None:
        return _fastest_measured(shapes, dtype, timer)
    if int4_kernel_is_fast():
        logger.info(
            "quantization auto: the built-in %s runs int4 on this AVX512 CPU: its Q4_1 GGUF's own "
            "4-bit grid, the lm_head int8, the fastest format measured at one row; --quantization none "
            "keeps it float",
            DEFAULT_MODEL_NAME,
        )
        return INT4
    logger.info(
        "quantization auto: the built-in %s runs int8 on this CPU (torch's int4 kernel has no fast "
        "path without AVX512, here %s); --quantization none keeps it float",
        DEFAULT_MODEL_NAME,
        torch.backends.cpu.get_cpu_capability(),
    )
    return INT8


def _fastest_measured(shapes: LinearShapes, dtype: str, timer: FormatTimer) -> str | None:
    """The candidate whose step linears took least at one row (ties: the first of int4, int8, float)."""
    dense_dtype = torch.bfloat16 if dtype == "bfloat16" or cpu_has_native_bf16() else torch.float32  # resolve_dtype's
    start = time.perf_counter()
    measured = measured_formats(shapes, AUTO_CANDIDATES, dense_dtype, timer)
    times = measured.times
    chosen = min(AUTO_CANDIDATES, key=lambda kind: times[kind].one_row_ms)
    names = {INT4: "int4", INT8: "int8", DENSE: str(dense_dtype).removeprefix("torch.").replace("bfloat16", "bf16")}
    others = ", ".join(f"{names[k]} {times[k].one_row_ms:.2f}" for k in AUTO_CANDIDATES if k != chosen)
    few = ", ".join(f"{names[k]} {times[k].few_rows_ms:.2f}" for k in AUTO_CANDIDATES)
    if measured.from_cache:
        where = f"measured on this CPU at {measured.measured_at}, read from {measured.folder}"
    else:
        where = f"measured on this CPU in {time.perf_counter() - start:.1f} s, cached in {measured.folder}"
    threads = torch.get_num_threads()
    logger.info(
        "quantization auto: %s for the built-in %s (a step's linears on %d thread%s at 1 row: %.2f ms vs %s; "
        "at %d rows: %s; %s); --quantization int4/int8/none sets it",
        names[chosen],
        DEFAULT_MODEL_NAME,
        threads,
        "" if threads == 1 else "s",
        times[chosen].one_row_ms,
        others,
        FEW_ROWS,
        few,
        where,
    )
    return None if chosen == DENSE else chosen


def int8_dense_from_rows(requested: str | None, scheme: str | None) -> int:
    """The row count from which int8/int4 linears use a dense copy of their weights (bf16 packed
    for oneDNN, or float32 without native bf16): only when `--quantization auto` chose the scheme
    (it trades memory for speed on a small built-in model); 0 (no copy) otherwise, so an explicit
    --quantization int8/int4 keeps its memory saving."""
    if requested != "auto":
        return 0
    if scheme == INT4:
        rows = AUTO_INT4_DENSE_FROM_ROWS if cpu_has_native_bf16() else AUTO_INT4_DENSE_FROM_ROWS_NO_BF16
        logger.info(
            "quantization auto: inputs of %d rows or more (prefills, larger decode batches) multiply a "
            "dense %s copy of the checkpoint's weights, faster there than the int4 kernel",
            rows,
            "bf16 oneDNN-packed" if cpu_has_native_bf16() else "float32",
        )
        return rows
    return AUTO_INT8_DENSE_FROM_ROWS if scheme == INT8 else 0
