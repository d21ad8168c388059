"""How the model's linear layers get NVFP4 weights: the method a checkpoint declares (ModelOpt or
compressed-tensors tensors, read from config.json / hf_quant_config.json) or float weights quantized
at load (`--quantization nvfp4`); each layout's per-linear tensors (shared by the loader and the
`fp4serve quantize` writer); and `NVFP4LinearBuilder`, which turns one linear's tensors into a module."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.shard_checks import check_shape, copy_bias_shard
from kernels.nvfp4 import (
    BLOCK_SIZE,
    NVFP4FormatError,
    NVFP4Weight,
    from_compressed_tensors,
    from_modelopt,
    fuse_nvfp4,
    to_compressed_tensors,
    to_modelopt,
)
from kernels.nvfp4_matmul import NVFP4Linear
from kernels.nvfp4_scale_search import quantize_nvfp4_searched

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
CHECKPOINT_FORMATS = (MODELOPT, COMPRESSED_TENSORS)
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
HF_QUANT_CONFIG = "hf_quant_config.json"

# Per-linear tensors of each layout: (the ones an NVFP4Weight is made of, the W4A4-only ones we skip).
_TENSORS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    MODELOPT: (("weight", "weight_scale", "weight_scale_2"), ("input_scale",)),
    COMPRESSED_TENSORS: (("weight_packed", "weight_scale", "weight_global_scale"), ("input_global_scale",)),
}
# Every tensor suffix a linear may carry, in either NVFP4 layout or block-wise FP8 (engine/weights/formats/fp8.py,
# its `weight_scale_inv`); the loader's name rules use it.
LINEAR_SUFFIXES = ("bias", "weight_scale_inv") + tuple(
    dict.fromkeys(s for req, skip in _TENSORS.values() for s in req + skip)
)
# NOTE: ModelOpt names its packed tensor `weight`, like an excluded bf16 linear's; the block
# scale beside it is what tells the two apart.
_MARKER = {MODELOPT: "weight_scale", COMPRESSED_TENSORS: "weight_packed"}

# The HF linears quantized at load and by `fp4serve quantize`: attention and MLP projections.
# lm_head, embeddings and norms stay in the model dtype (the usual exclude list).
# Hybrids (Qwen3.5): also the DeltaNet qkv/z/out projections; in_proj_a/b stay float (see qwen3_5.py).
# MoE models add each expert's and the shared expert's projections; the router (`mlp.gate`) stays float.
_QUANTIZABLE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)$"
)


NVFP4 = "nvfp4"
INT8 = "int8"  # engine/weights/formats/int8_linear.py: per-channel int8 quantized at load, CPU only
INT4 = "int4"  # engine/weights/formats/int4_linear.py: int4 in groups of 32 quantized at load, CPU only
SCHEMES = (NVFP4, INT8, INT4)  # --quantization's choices
CPU_SCHEMES = (INT8, INT4)  # weight-only, quantized at load from float weights, CPU kernels


@dataclass(frozen=True)
class QuantizationMethod:
    """Where the quantized linears come from. Plain values, decided once before loading."""

    checkpoint_format: str | None  # modelopt | compressed-tensors: packed in the checkpoint; None: quantize at load
    source: str  # where it was declared: "config.json", "hf_quant_config.json" or "--quantization nvfp4"
    # What the checkpoint asks for that this server does not run (W4A4 activations, FP8 KV), for the log.
    ignored: tuple[str, ...] = ()
    scheme: str = NVFP4  # nvfp4 | int8 | int4 (int8, int4: quantized at load only)
    int8_lm_head: bool = True  # int8/int4: the lm_head too (a copy when tied; docs/PERF.md has the trade)
    # int8/int4: inputs of this many rows or more use a dense copy of the dequantized weights and the
    # float GEMM (Int8Linear.keep_dense_copy, Int4Linear's dense_from_rows); 0: never (no copy).
    int8_dense_from_rows: int = 0

    def __post_init__(self) -> None:
        assert self.checkpoint_format in (None, *CHECKPOINT_FORMATS), f"unknown format {self.checkpoint_format}"
        assert self.scheme in SCHEMES, f"unknown scheme {self.scheme}"
        assert self.scheme == NVFP4 or self.checkpoint_format is None, f"{self.scheme} is quantized at load only"

    @property
    def quantize_at_load(self) -> bool:
        return self.checkpoint_format is None

    def describe(self) -> str:
        if self.scheme == INT8:
            return (
                f"float linears quantized to int8 at load ({self.source}); weight-only int8, one symmetric "
                "scale per output channel, activations in the model dtype"
            )
        if self.scheme == INT4:
            return (
                f"float linears quantized to int4 at load ({self.source}); weight-only int4, a scale and a zero "
                "point per group of 32 input columns (Q4_1's grid), bf16 activations"
            )
        what = (
            "float linears quantized to NVFP4 at load"
            if self.quantize_at_load
            else f"NVFP4 {self.checkpoint_format} checkpoint"
        )
        text = f"{what} ({self.source}); weight-only NVFP4, activations in the model dtype"
        return text + "".join(f"; ignored: {item}" for item in self.ignored)


def detect_quantization(
    folder: Path, checkpoint_config: Mapping[str, Any] | None, requested: str | None
) -> QuantizationMethod | None:
    """The method for a checkpoint folder; `checkpoint_config` is config.json's quantization_config
    (ModelConfig.quantization) and `requested` is EngineConfig.quantization.

    Raises ConfigError (one line naming the field) for a quantization this server cannot run."""
    if requested not in (None, *SCHEMES):
        raise ConfigError(f"--quantization: '{requested}' is not one of {', '.join(SCHEMES)}")
    hf_quant = folder / HF_QUANT_CONFIG
    if _is_fp8(checkpoint_config):
        return _fp8_checkpoint_method(checkpoint_config, requested)
    if requested in CPU_SCHEMES:
        if checkpoint_config is not None or hf_quant.is_file():
            where = "config.json's quantization_config" if checkpoint_config is not None else HF_QUANT_CONFIG
            raise ConfigError(
                f"--quantization {requested}: the checkpoint is already quantized ({where}); "
                f"{requested} quantizes float checkpoints only (drop --quantization to run it as it is)"
            )
        return QuantizationMethod(None, f"--quantization {requested}", scheme=requested)
    if checkpoint_config is not None:
        if not isinstance(checkpoint_config, Mapping):
            raise ConfigError("config.json: field 'quantization_config' must be an object")
        method = checkpoint_config.get("quant_method")
        if method == COMPRESSED_TENSORS:
            return _compressed_tensors_method(checkpoint_config)
        if method != MODELOPT:
            raise ConfigError(
                f"config.json: unsupported quantization '{method}' in field 'quantization_config.quant_method'; "
                f"supported: {MODELOPT} (NVFP4), {COMPRESSED_TENSORS} ({CT_NVFP4_FORMAT}), fp8 (block-wise)"
            )
        if not hf_quant.is_file():
            return _modelopt_method(checkpoint_config, "config.json", "quantization_config.")
    if hf_quant.is_file():
        try:
            raw = json.loads(hf_quant.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{hf_quant}: invalid JSON ({e})") from None
        section = raw.get("quantization") if isinstance(raw, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"{HF_QUANT_CONFIG}: missing field 'quantization'")
        return _modelopt_method(section, HF_QUANT_CONFIG, "quantization.")
    if requested == "nvfp4":
        return QuantizationMethod(None, "--quantization nvfp4")
    return None


def _is_fp8(checkpoint_config: Mapping[str, Any] | None) -> bool:
    return isinstance(checkpoint_config, Mapping) and checkpoint_config.get("quant_method") == "fp8"


def _fp8_checkpoint_method(checkpoint_config: Mapping[str, Any], requested: str | None) -> QuantizationMethod | None:
    """A block-wise FP8 checkpoint: its linears are FP8 or dequantized by the loader (engine/weights/formats/fp8.py);
    a requested scheme re-quantizes the dequantized weights, else None (the checkpoint as it is)."""
    from engine.weights.formats.fp8 import fp8_format  # engine.weights.formats.fp8 builds on this module

    fmt = fp8_format(checkpoint_config)  # checks the declaration: one line naming a bad field
    assert fmt is not None, "an fp8 quant_method has a format"
    if requested is None:
        return None
    source = f"--quantization {requested}, from the dequantized {fmt.describe()} weights"
    return QuantizationMethod(None, source, scheme=requested)


def _modelopt_method(cfg: Mapping[str, Any], source: str, prefix: str) -> QuantizationMethod:
    algo = cfg.get("quant_algo")
    if algo != "NVFP4":
        raise ConfigError(
            f"{source}: unsupported quant_algo {algo!r} in field '{prefix}quant_algo'; supported: 'NVFP4'"
        )
    group_size = cfg.get("group_size", BLOCK_SIZE)
    if group_size != BLOCK_SIZE:
        raise ConfigError(
            f"{source}: NVFP4 needs group_size {BLOCK_SIZE}, got {group_size!r} in field '{prefix}group_size'"
        )
    ignored: list[str] = []
    if cfg.get("kv_cache_quant_algo"):
        ignored.append(
            f"{cfg['kv_cache_quant_algo']} KV cache ({prefix}kv_cache_quant_algo): the cache stays in the model dtype"
        )
    return QuantizationMethod(MODELOPT, source, tuple(ignored))


def _compressed_tensors_method(cfg: Mapping[str, Any]) -> QuantizationMethod:
    source, top_format = "config.json", cfg.get("format")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: missing field 'quantization_config.config_groups'")
    ignored: list[str] = []
    for name, group in groups.items():
        path = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ConfigError(f"{source}: field '{path}' must be an object")
        group_format = group.get("format") or top_format
        if group_format != CT_NVFP4_FORMAT:
            field = f"{path}.format" if group.get("format") else "quantization_config.format"
            raise ConfigError(
                f"{source}: unsupported compressed-tensors format {group_format!r} in field "
                f"'{field}'; supported: '{CT_NVFP4_FORMAT}'"
            )
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ConfigError(f"{source}: missing field '{path}.weights'")
        for key, want in (("num_bits", 4), ("type", "float"), ("group_size", BLOCK_SIZE)):
            if weights.get(key) != want:
                raise ConfigError(
                    f"{source}: NVFP4 weights need {key} {want!r}, got {weights.get(key)!r} "
                    f"in field '{path}.weights.{key}'"
                )
    if any(isinstance(g, dict) and g.get("input_activations") for g in groups.values()):
        ignored.append("W4A4 activation quantization (input_activations): activations stay in the model dtype")
    if cfg.get("kv_cache_scheme"):
        ignored.append(
            "KV cache quantization (quantization_config.kv_cache_scheme): the cache stays in the model dtype"
        )
    return QuantizationMethod(COMPRESSED_TENSORS, source, tuple(ignored))


def check_quantizable(cfg: ModelConfig, who: str) -> None:
    """Every quantizable linear's input size must hold whole 16-element blocks."""
    for field, size in (
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("num_attention_heads * head_dim", cfg.num_heads * cfg.head_dim),
        *(
            (("linear_num_value_heads * linear_value_head_dim", cfg.hybrid.value_dim),)
            if cfg.hybrid is not None
            else ()
        ),
    ):
        if size % BLOCK_SIZE:
            raise ConfigError(f"{who}: {field} = {size} is not a multiple of {BLOCK_SIZE} (the NVFP4 block)")


def is_quantizable(hf_module: str) -> bool:
    """True for the HF linears quantized at load and by `fp4serve quantize` (q/k/v/o, gate/up/down)."""
    return _QUANTIZABLE.match(hf_module) is not None


def is_packed(checkpoint_format: str, tensor_names: Collection[str], hf_module: str) -> bool:
    """Whether the checkpoint holds `hf_module` (e.g. model.layers.0.self_attn.q_proj) as NVFP4."""
    return f"{hf_module}.{_MARKER[checkpoint_format]}" in tensor_names


def tensor_roles(checkpoint_format: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(suffixes an NVFP4 linear needs, suffixes that may be present and are skipped)."""
    return _TENSORS[checkpoint_format]


def weight_from_tensors(checkpoint_format: str, parts: Mapping[str, Tensor], hf_module: str) -> NVFP4Weight:
    """One linear's checkpoint tensors (by suffix) -> NVFP4Weight; ConfigError names the linear."""
    try:
        if checkpoint_format == MODELOPT:
            return from_modelopt(parts)
        return from_compressed_tensors(parts)
    except NVFP4FormatError as e:
        raise ConfigError(f"{hf_module}: {e}") from None


def weight_to_tensors(checkpoint_format: str, weight: NVFP4Weight) -> dict[str, Tensor]:
    """NVFP4Weight (one shard) -> the layout's tensors by suffix."""
    return to_modelopt(weight) if checkpoint_format == MODELOPT else to_compressed_tensors(weight)


def quantize_weight(weight: Tensor, hf_name: str) -> NVFP4Weight:
    """The quantize-at-load method: one checkpoint tensor [N, K], as stored, -> NVFP4Weight.

    NOTE: the stored values are quantized, not a copy cast to the model dtype, so the result
    equals what `fp4serve quantize` writes for the same tensor whatever --dtype is. Each block's
    scale is searched (kernels/nvfp4_scale_search.py): on SmolLM2-135M it closed a fifth of the
    perplexity gap to float32 (docs/PERF.md)."""
    try:
        return quantize_nvfp4_searched(weight)
    except NVFP4FormatError as e:
        raise ConfigError(f"{hf_name}: {e}") from None


class NVFP4LinearBuilder:
    """Assembles one NVFP4 linear (its shards fused: q/k/v, gate/up) from checkpoint tensors that
    stream in any order, across files; `build` once all have arrived."""

    def __init__(
        self,
        method: QuantizationMethod,
        hf_modules: list[str],
        shard_sizes: list[int],
        in_features: int,
        bias: Tensor | None,
        device: torch.device,
    ) -> None:
        assert len(hf_modules) == len(shard_sizes), "one checkpoint linear per shard"
        self.method = method
        self.hf_modules = hf_modules  # per shard, e.g. model.layers.0.self_attn.q_proj
        self.shard_sizes = shard_sizes
        self.in_features = in_features
        self.bias = bias  # [N] model dtype on `device`, filled shard by shard; None: no bias
        self.device = device
        self.weights: list[NVFP4Weight | None] = [None] * len(shard_sizes)
        self.parts: list[dict[str, Tensor]] = [{} for _ in shard_sizes]  # per shard: suffix -> tensor

    def add(self, shard: int, suffix: str, tensor: Tensor) -> None:
        """One tensor of shard `shard` (`suffix` as in LINEAR_SUFFIXES, W4A4 scales excluded)."""
        hf_module, rows = self.hf_modules[shard], self.shard_sizes[shard]
        fmt = self.method.checkpoint_format
        if suffix == "bias":
            copy_bias_shard(self.bias, hf_module, self.shard_sizes, shard, tensor)
        elif fmt is None:
            if suffix != "weight":
                raise ConfigError(
                    f"tensor '{hf_module}.{suffix}' is a quantization tensor, but the checkpoint "
                    "declares no quantization"
                )
            check_shape(f"{hf_module}.weight", tensor.shape, (rows, self.in_features))
            self.weights[shard] = quantize_weight(tensor.to(self.device), f"{hf_module}.weight")
        else:
            needed, _ = _TENSORS[fmt]
            assert suffix in needed, f"{hf_module}.{suffix}: not a weight tensor of {fmt}"
            self.parts[shard][suffix] = tensor
            if len(self.parts[shard]) == len(needed):
                weight = weight_from_tensors(fmt, self.parts[shard], hf_module)
                if weight.shape != (rows, self.in_features):
                    raise ConfigError(
                        f"{hf_module}: NVFP4 weight of shape {list(weight.shape)} (packed "
                        f"{list(weight.packed.shape)}), expected {[rows, self.in_features]}"
                    )
                self.weights[shard], self.parts[shard] = weight, {}

    def build(self) -> NVFP4Linear:
        """The module, on the device; ConfigError names the first tensor that never came."""
        fmt = self.method.checkpoint_format
        for hf_module, weight, parts in zip(self.hf_modules, self.weights, self.parts):
            if weight is None:
                absent = [s for s in (("weight",) if fmt is None else _TENSORS[fmt][0]) if s not in parts]
                raise ConfigError(f"missing tensor for '{hf_module}.{absent[0]}'")
        shards = [w for w in self.weights if w is not None]
        # Fused shards keep a global scale each: exact, where one shared scale would re-round them.
        fused = shards[0] if len(shards) == 1 else fuse_nvfp4(shards)
        return NVFP4Linear(fused.to(self.device), self.bias)


def checkpoint_quantization_config(checkpoint_format: str, exclude: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for a weight-only NVFP4 checkpoint written by us."""
    if checkpoint_format == MODELOPT:
        return {
            "quant_method": MODELOPT,
            "quant_algo": "NVFP4",
            "group_size": BLOCK_SIZE,
            "kv_cache_quant_algo": None,
            "exclude_modules": exclude,
        }
    weights = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": BLOCK_SIZE,
        "symmetric": True,
        "dynamic": False,
    }
    return {
        "quant_method": COMPRESSED_TENSORS,
        "format": CT_NVFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": CT_NVFP4_FORMAT,
            }
        },
        "ignore": exclude,
        "kv_cache_scheme": None,
    }


def hf_quant_config(exclude: list[str], producer_version: str) -> dict[str, Any]:
    """ModelOpt's hf_quant_config.json for a weight-only NVFP4 checkpoint written by us."""
    return {
        "producer": {"name": "fp4serve", "version": producer_version},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": BLOCK_SIZE,
            "kv_cache_quant_algo": None,
            "exclude_modules": exclude,
        },
    }
