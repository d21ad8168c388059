"""Which CPU weight format runs a model's linears fastest on the CPU at hand, as measured: the
linears of one decode step (each layer's q/k/v/o/gate/up/down at their true shapes, and the
lm_head) timed at one row and at a few rows for int4, int8 and the dense float format, within a
fixed time budget; the figures cached per CPU, torch, compiled ops and shapes in the cache folder
(engine/host/cache_folder.py), so later starts read them instead of measuring again."""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.host.cache_folder import build_once, cache_root
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.int4_linear import GROUP_SIZE, INT4_ACTIVATION_DTYPE, Int4Linear
from engine.weights.formats.int8_linear import Int8Linear
from engine.weights.formats.nvfp4 import INT4, INT8
from engine.weights.formats.packed_linear import can_pack, pack_weight, packed_linear
from kernels.cpu_ops import build_key, ops_loaded

logger = logging.getLogger("fp4serve.runner")

DENSE = "none"  # the candidate that keeps the checkpoint's weights in a float dtype
FEW_ROWS = 4  # a speculative verify step's rows (k + 1), or a small decode batch
TIME_BUDGET_S = 1.5  # building the candidates' weights and timing them; at least MIN_REPEATS passes each
MIN_REPEATS = 2
# Layer copies are cycled until they exceed the last-level cache, so every call streams its weights
# from memory as a real step does (one layer's int4 weights alone would sit in cache).
STREAMED_BYTES = 64 << 20
_TIMES_FILE = "format_times.json"
_MAX_REPEATS = 50


@dataclass(frozen=True)
class LinearShapes:
    """(out_features, in_features) of the linears one decoder layer runs, fused as the model fuses
    them (qkv, o, gate_up, down), the layer count, and the lm_head's."""

    layer: tuple[tuple[int, int], ...]
    num_layers: int
    head: tuple[int, int]

    @staticmethod
    def of(cfg: ModelConfig) -> LinearShapes:
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        i = cfg.intermediate_size
        return LinearShapes(((q + 2 * kv, h), (h, q), (2 * i, h), (h, i)), cfg.num_layers, (cfg.vocab_size, h))


@dataclass(frozen=True)
class FormatTiming:
    """One step's linears (every layer and the head), best of the repeats, in milliseconds."""

    one_row_ms: float
    few_rows_ms: float


FormatTimes = dict[str, FormatTiming]  # by candidate: INT4, INT8 or DENSE
FormatTimer = Callable[[LinearShapes, tuple[str, ...], torch.dtype], FormatTimes]


@dataclass(frozen=True)
class MeasuredFormats:
    times: FormatTimes
    folder: Path  # where the figures are cached
    from_cache: bool
    measured_at: str  # UTC, to the minute


def _step_linears(
    kind: str, shapes: LinearShapes, dense_dtype: torch.dtype, int8_head: Int8Linear
) -> tuple[list[list[Callable[[Tensor], Tensor]]], Callable[[Tensor], Tensor], torch.dtype]:
    """Layer copies (each a list of x -> y over the layer's shapes), the head, and the activation
    dtype, in the modules the loader builds for `kind`; `int8_head` is the head int4 and int8 share.

    NOTE: the weights are constants, written (not calloc's shared zero page, which would sit in
    cache): these kernels take the same time whatever the values, and filling is cheaper than
    drawing and quantizing random ones."""
    if kind in (INT4, INT8):
        dtype = INT4_ACTIVATION_DTYPE
        if kind == INT4:
            layer: list[Int4Linear | Int8Linear] = [
                Int4Linear(
                    torch.full((n, -(-k // GROUP_SIZE) * GROUP_SIZE), 9, dtype=torch.uint8),  # [N, Kp]
                    torch.full((-(-k // GROUP_SIZE), n, 2), 0.01, dtype=dtype),
                    None,
                    k,
                )  # [Kp / 32, N, 2]
                for n, k in shapes.layer
            ]
        else:
            layer = [
                Int8Linear(torch.full((n, k), 3, dtype=torch.int8), torch.full((n,), 0.01, dtype=dtype), None)
                for n, k in shapes.layer
            ]
        nbytes = sum(m.weight_nbytes for m in layer)
        copies = [layer] + [copy.deepcopy(layer) for _ in range(_num_copies(nbytes, shapes) - 1)]
        return [[m.quantized_mm for m in c] for c in copies], int8_head.quantized_mm, dtype
    assert kind == DENSE, f"unknown candidate {kind}"
    packed = can_pack(dense_dtype, torch.device("cpu"))  # as pack_float_linears runs a bf16 model
    dtype = torch.bfloat16 if packed else dense_dtype
    nbytes = sum(n * k for n, k in shapes.layer) * torch.tensor([], dtype=dtype).element_size()
    if packed:

        def linear(n: int, k: int) -> Callable[[Tensor], Tensor]:
            p = pack_weight(torch.full((n, k), 0.01, dtype=torch.bfloat16))
            return lambda x: packed_linear(x, p, None)

        copies = [[linear(n, k) for n, k in shapes.layer] for _ in range(_num_copies(nbytes, shapes))]
        return copies, linear(*shapes.head), dtype

    def plain(n: int, k: int) -> Callable[[Tensor], Tensor]:
        w = torch.full((n, k), 0.01, dtype=dtype)  # [N, K]
        return lambda x: F.linear(x, w)

    copies = [[plain(n, k) for n, k in shapes.layer] for _ in range(_num_copies(nbytes, shapes))]
    head_t = torch.full(shapes.head[::-1], 0.01, dtype=dtype)  # [hidden, vocab]: keep_transposed_lm_head
    return copies, lambda x: x @ head_t, dtype


def _num_copies(layer_bytes: int, shapes: LinearShapes) -> int:
    return max(1, min(shapes.num_layers, math.ceil(STREAMED_BYTES / max(layer_bytes, 1))))


def _one_pass(
    copies: list[list[Callable[[Tensor], Tensor]]],
    head: Callable[[Tensor], Tensor],
    x: Tensor,
    xs: list[Tensor],
    num_layers: int,
) -> float:
    """Seconds for one step's linears: every copy's layer (scaled to the model's layer count) and the
    head; `x` the head's input, `xs` each layer linear's."""
    start = time.perf_counter()
    for layer in copies:
        for fn, x_in in zip(layer, xs):
            fn(x_in)
    layers = time.perf_counter() - start
    start = time.perf_counter()
    head(x)
    return layers * num_layers / len(copies) + time.perf_counter() - start


def time_formats(
    shapes: LinearShapes, candidates: tuple[str, ...], dense_dtype: torch.dtype, budget_s: float = TIME_BUDGET_S
) -> FormatTimes:
    """Time one step's linears for each candidate at 1 and FEW_ROWS rows: the candidates take turns
    (a neighbour's burst of load hits them alike) until `budget_s` is spent, counted from the
    start (building included); best of the repeats."""
    deadline = time.perf_counter() + budget_s
    vocab, hidden = shapes.head
    head = Int8Linear(
        torch.full((vocab, hidden), 3, dtype=torch.int8),  # [V, H]
        torch.full((vocab,), 0.01, dtype=INT4_ACTIVATION_DTYPE),
        None,
    )
    head.cpu_gemv = ops_loaded()  # as use_cpu_gemv sets it
    built = {kind: _step_linears(kind, shapes, dense_dtype, head) for kind in candidates}
    inputs: dict[tuple[str, int], tuple[Tensor, list[Tensor]]] = {}
    for kind, (_, _, dtype) in built.items():
        for rows in (1, FEW_ROWS):
            xs = [torch.randn(rows, k).to(dtype) for _, k in shapes.layer]  # [rows, K] activation dtype
            inputs[kind, rows] = torch.randn(rows, shapes.head[1]).to(dtype), xs
    best: dict[tuple[str, int], float] = {key: math.inf for key in inputs}
    with torch.inference_mode():
        for kind, (copies, head_mm, _) in built.items():  # a first, untimed pass: oneDNN primitives, page faults
            for rows in (1, FEW_ROWS):
                _one_pass(copies, head_mm, *inputs[kind, rows], shapes.num_layers)
        for repeat in range(_MAX_REPEATS):
            for (kind, rows), (x, xs) in inputs.items():
                copies, head_mm, _ = built[kind]
                best[kind, rows] = min(best[kind, rows], _one_pass(copies, head_mm, x, xs, shapes.num_layers))
            if time.perf_counter() > deadline and repeat + 1 >= MIN_REPEATS:
                break
    return {kind: FormatTiming(best[kind, 1] * 1e3, best[kind, FEW_ROWS] * 1e3) for kind in candidates}


def timing_key(shapes: LinearShapes, candidates: tuple[str, ...], dense_dtype: torch.dtype) -> str:
    """What the figures depend on: the CPU's model and flags, torch and the compiled ops (build_key),
    whether those are loaded, the thread count, the shapes and the candidates."""
    parts = {
        "build": build_key(),
        "ops": ops_loaded(),
        "threads": torch.get_num_threads(),
        "shapes": asdict(shapes),
        "candidates": list(candidates),
        "dense": str(dense_dtype),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def measured_formats(
    shapes: LinearShapes, candidates: tuple[str, ...], dense_dtype: torch.dtype, timer: FormatTimer = time_formats
) -> MeasuredFormats:
    """The candidates' times from the cache folder, or measured by `timer` and cached there (again
    when the cached file cannot be read: written by another version, or damaged)."""
    folder = cache_root() / "quantization-auto" / f"times-{timing_key(shapes, candidates, dense_dtype)}"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    measured: list[FormatTimes] = []

    def build(staging: Path) -> None:
        times = timer(shapes, candidates, dense_dtype)
        measured.append(times)
        record = {"measured_at": now, "times": {k: asdict(t) for k, t in times.items()}}
        (staging / _TIMES_FILE).write_text(json.dumps(record, indent=2) + "\n")

    for _ in range(2):  # the second pass rebuilds a folder the first could not read
        try:
            folder = build_once(folder, build)
        except OSError as e:  # a read-only cache: the figures serve this start only
            logger.warning("quantization auto: could not cache the measured times in %s (%s)", folder, e)
            if not measured:
                measured.append(timer(shapes, candidates, dense_dtype))
        if measured:
            return MeasuredFormats(measured[0], folder, from_cache=False, measured_at=now)
        try:
            raw = json.loads((folder / _TIMES_FILE).read_text())
            times = {k: FormatTiming(**v) for k, v in raw["times"].items()}
            if set(times) == set(candidates):
                return MeasuredFormats(times, folder, from_cache=True, measured_at=str(raw["measured_at"]))
            why = f"its candidates are {sorted(times)}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
        logger.warning("quantization auto: %s is unreadable (%s); measuring again", folder / _TIMES_FILE, why)
        shutil.rmtree(folder, ignore_errors=True)
    # Still there after removing it (another user's cache): measured for this start only.
    return MeasuredFormats(timer(shapes, candidates, dense_dtype), folder, from_cache=False, measured_at=now)
