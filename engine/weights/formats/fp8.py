"""Block-wise FP8 checkpoints (`quantization_config.quant_method: fp8`: Qwen's and DeepSeek's FP8
releases): the config check, the name rules of their scale tensors, `Fp8Dequantizer`, which pairs
each float8 weight with its scale as the checkpoint streams in and hands the loader float32 weights
(on CPU, and wherever the weights are re-quantized), and `Fp8LinearBuilder` for the linears a
GPU with FP8 tensor cores keeps in FP8 (W8A8, kernels.fp8_block.Fp8Linear).

Layout (as transformers' FineGrainedFP8 and vLLM's Fp8LinearMethod read it): a linear `X` has
`X.weight` [N, K] float8_e4m3fn and `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)] float32, the
factor each [bn x bk] block's codes are multiplied by; fused experts `P` ([E, N, K], e.g.
`mlp.experts.gate_up_proj`) have `P_scale_inv` [E, ...]. Linears left in bf16 (routers, lm_head,
Qwen3.5's in_proj_a/b: `modules_to_not_convert`) simply have no scale; the tensors, not the list,
decide."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.errors import ConfigError
from engine.weights.formats.shard_checks import check_shape, copy_bias_shard
from kernels.fp8_block import (
    FP8_DTYPE,
    Fp8BlockWeight,
    check_block_scale,
    dequantize_block_fp8,
    fp8_device_supported,
    fuse_fp8,
)
from kernels.fp8_dispatch import Fp8Linear
from kernels.fused_moe_fp8 import Fp8ExpertWeights

FP8_METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv; fused experts P -> P_scale_inv
WEIGHT_SCALE = "weight" + SCALE_SUFFIX
# Scales of other FP8 flavours (per-tensor weight scales, static activation scales): not block-wise.
_OTHER_SCALES = (".weight_scale", ".input_scale", ".activation_scale")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Fp8Format:
    """What config.json's quantization_config declares, checked."""

    block: tuple[int, int]  # weight_block_size: (rows, columns) per scale
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers, for the log

    def describe(self) -> str:
        return f"FP8 block-wise (e4m3, {self.block[0]}x{self.block[1]} blocks, dynamic activation scales)"

    @property
    def kernel_ready(self) -> bool:
        """The Triton kernels walk K one weight block at a time, a power of two of at least 16."""
        bk = self.block[1]
        return bk >= 16 and bk & (bk - 1) == 0


def fp8_format(quantization_config: Mapping[str, Any] | None, source: str = "config.json") -> Fp8Format | None:
    """The FP8 format config.json declares, None for any other (or no) quantization.

    Raises ConfigError (one line naming the field) for an FP8 flavour this server does not read."""
    if not isinstance(quantization_config, Mapping) or quantization_config.get("quant_method") != FP8_METHOD:
        return None
    prefix = "quantization_config."
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: unsupported FP8 format {fmt!r} in field '{prefix}fmt'; supported: 'e4m3'")
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"{source}: unsupported FP8 activation scheme {scheme!r} in field "
            f"'{prefix}activation_scheme'; block-wise FP8 needs 'dynamic'"
        )
    block = quantization_config.get("weight_block_size")
    if block is None:
        raise ConfigError(
            f"{source}: per-tensor FP8 (no '{prefix}weight_block_size') is not supported; "
            "supported: block-wise FP8 such as [128, 128]"
        )
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(f"{source}: field '{prefix}weight_block_size' must be two positive integers, got {block!r}")
    ignored = quantization_config.get("modules_to_not_convert") or quantization_config.get("ignored_layers") or ()
    return Fp8Format((block[0], block[1]), tuple(str(m) for m in ignored))


def keeps_fp8(fmt: Fp8Format, device: torch.device, requantized: bool) -> bool:
    """Whether linears stay FP8 (W8A8 on FP8 tensor cores): on CUDA SM89+ unless the weights are
    quantized again (--quantization nvfp4 / int8). Elsewhere they are dequantized at load."""
    return not requantized and fmt.kernel_ready and fp8_device_supported(device)


class Fp8Dequantizer:
    """Pairs float8 weights with their scales in a tensor stream (either may come first, even in
    another shard) and yields float32 weights in their place; everything else passes through.
    `keep(name)`: tensors passed through as stored (linears kept in FP8). Fused expert tensors come
    out per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`), so no more than one expert's
    float copy exists at a time."""

    def __init__(self, fmt: Fp8Format, keep: Callable[[str], bool] | None = None) -> None:
        self.block = fmt.block
        self.keep = keep or (lambda name: False)
        self.codes: dict[str, Tensor] = {}  # weight name -> float8 codes waiting for their scale
        self.scales: dict[str, Tensor] = {}  # weight name -> scale waiting for its codes
        self.num_dequantized = 0

    def feed(self, name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        if self.keep(name):
            yield name, tensor
            return
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            codes = self.codes.pop(base, None)
            if codes is None:
                self.scales[base] = tensor
                return
            yield from self._dequantize(base, codes, tensor)
            return
        if tensor.dtype == FP8_DTYPE:
            scale = self.scales.pop(name, None)
            if scale is None:
                self.codes[name] = tensor
                return
            yield from self._dequantize(name, tensor, scale)
            return
        if name.endswith(_OTHER_SCALES):
            raise ConfigError(
                f"tensor '{name}': not a block-wise FP8 tensor (per-tensor or static activation "
                "scales are not supported)"
            )
        yield name, tensor

    def finish(self) -> None:
        """ConfigError naming the first weight without its scale, or scale without its weight."""
        for name in self.codes:
            raise ConfigError(f"tensor '{name}' is float8_e4m3fn but '{scale_name(name)}' is missing")
        for name in self.scales:
            raise ConfigError(f"tensor '{scale_name(name)}' has no float8_e4m3fn weight '{name}'")

    def _dequantize(self, name: str, codes: Tensor, scale: Tensor) -> Iterator[tuple[str, Tensor]]:
        if codes.dtype != FP8_DTYPE:
            raise ConfigError(
                f"tensor '{name}' is {str(codes.dtype).removeprefix('torch.')}, but has a block "
                f"scale '{scale_name(name)}'"
            )
        problem = check_block_scale(tuple(codes.shape), tuple(scale.shape), self.block)
        if problem is not None:
            raise ConfigError(f"tensor '{scale_name(name)}': {problem}")
        self.num_dequantized += 1
        fused = _FUSED_EXPERTS.fullmatch(name)
        if codes.dim() == 3 and fused is not None:
            prefix, which = fused.group(1), fused.group(2)
            for e in range(codes.shape[0]):
                w = dequantize_block_fp8(codes[e], scale[e], self.block)  # one expert's [N, K] float32
                if which == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", w
                else:
                    gate, up = w.chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
            return
        yield name, dequantize_block_fp8(codes, scale, self.block)


def scale_name(weight_name: str) -> str:
    """The scale tensor's name for a weight name (X.weight -> X.weight_scale_inv)."""
    return weight_name + SCALE_SUFFIX


def is_fp8_linear(tensor_names: set[str], hf_module: str) -> bool:
    """Whether the checkpoint stores linear `hf_module` (e.g. model.layers.0.self_attn.q_proj) in FP8."""
    return f"{hf_module}.{WEIGHT_SCALE}" in tensor_names


def fp8_weight(
    codes: Tensor, scale: Tensor, block: tuple[int, int], name: str, expected: tuple[int, int]
) -> Fp8BlockWeight:
    """One linear's (or expert's) checkpoint tensors, checked, as an Fp8BlockWeight."""
    if codes.dtype != FP8_DTYPE:
        raise ConfigError(
            f"tensor '{name}.weight' is {str(codes.dtype).removeprefix('torch.')}, expected "
            "float8_e4m3fn (it has a block scale)"
        )
    check_shape(f"{name}.weight", codes.shape, expected)
    problem = check_block_scale(tuple(codes.shape), tuple(scale.shape), block)
    if problem is not None:
        raise ConfigError(f"tensor '{name}.{WEIGHT_SCALE}': {problem}")
    return Fp8BlockWeight(codes, scale.float(), block[0], block[1])


class Fp8LinearBuilder:
    """One FP8 linear (its shards fused: q/k/v, gate/up) from checkpoint tensors that stream in any
    order; `build` once all have arrived."""

    def __init__(
        self,
        fmt: Fp8Format,
        hf_modules: list[str],
        shard_sizes: list[int],
        in_features: int,
        bias: Tensor | None,
        device: torch.device,
    ) -> None:
        assert len(hf_modules) == len(shard_sizes), "one checkpoint linear per shard"
        self.block = fmt.block
        self.hf_modules = hf_modules
        self.shard_sizes = shard_sizes
        self.in_features = in_features
        self.bias = bias  # [N] model dtype on `device`, filled shard by shard; None: no bias
        self.device = device
        self.parts: list[dict[str, Tensor]] = [{} for _ in shard_sizes]  # per shard: suffix -> tensor

    def add(self, shard: int, suffix: str, tensor: Tensor) -> None:
        hf_module = self.hf_modules[shard]
        if suffix == "bias":
            copy_bias_shard(self.bias, hf_module, self.shard_sizes, shard, tensor)
        elif suffix in ("weight", WEIGHT_SCALE):
            self.parts[shard][suffix] = tensor.to(self.device)
        else:
            raise ConfigError(f"tensor '{hf_module}.{suffix}': not a tensor of a block-wise FP8 linear")

    def build(self) -> Fp8Linear:
        shards = []
        for hf_module, rows, parts in zip(self.hf_modules, self.shard_sizes, self.parts):
            for suffix in ("weight", WEIGHT_SCALE):
                if suffix not in parts:
                    raise ConfigError(f"missing tensor for '{hf_module}.{suffix}'")
            shards.append(
                fp8_weight(parts["weight"], parts[WEIGHT_SCALE], self.block, hf_module, (rows, self.in_features))
            )
        self.parts = []
        return Fp8Linear(shards[0] if len(shards) == 1 else fuse_fp8(shards), self.bias)


class Fp8ExpertCollector:
    """One MoE block's FP8 experts as they stream in, per expert (`experts.{e}.{gate,up,down}_proj`)
    or fused (`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I], each with its
    `_scale_inv`); `build` stacks them as the FP8 fused-MoE kernel reads them."""

    def __init__(self, fmt: Fp8Format, num_experts: int, intermediate: int, hidden: int, device: torch.device) -> None:
        self.block = fmt.block
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.hidden = hidden
        self.device = device
        self.parts: dict[tuple[int, str], dict[str, Tensor]] = {}  # (expert, gate|up|down) -> suffix -> tensor
        self.fused: dict[str, dict[str, Tensor]] = {}  # gate_up_proj | down_proj -> "" | _scale_inv -> tensor

    def add_expert(self, expert: int, proj: str, suffix: str, tensor: Tensor, name: str) -> None:
        if suffix not in ("weight", WEIGHT_SCALE):
            raise ConfigError(f"tensor '{name}': unexpected for a block-wise FP8 expert")
        self.parts.setdefault((expert, proj), {})[suffix] = tensor.to(self.device)

    def add_fused(self, which: str, scale: bool, tensor: Tensor) -> None:
        self.fused.setdefault(which, {})[SCALE_SUFFIX if scale else ""] = tensor.to(self.device)

    def missing(self) -> str | None:
        """The first tensor name (after `mlp.experts.`) that has not arrived, or None."""
        for which, projs in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            if which in self.fused:
                for suffix in ("", SCALE_SUFFIX):
                    if suffix not in self.fused[which]:
                        return which + suffix
                continue
            for expert in range(self.num_experts):
                for proj in projs:
                    for suffix in ("weight", WEIGHT_SCALE):
                        if suffix not in self.parts.get((expert, proj), {}):
                            return f"{expert}.{proj}_proj.{suffix}"
        return None

    def build(self, prefix: str) -> tuple[Fp8ExpertWeights, Fp8ExpertWeights]:
        """(w13, w2) as the FP8 fused-MoE kernels read them; `prefix` names the block in errors."""
        e, i, h = self.num_experts, self.intermediate, self.hidden
        built = []
        for which, projs, shape in (("gate_up_proj", ("gate", "up"), (2 * i, h)), ("down_proj", ("down",), (h, i))):
            if which in self.fused:
                codes, scale = self.fused[which][""], self.fused[which][SCALE_SUFFIX]
                check_shape(f"{prefix}.{which}", codes.shape, (e, *shape))
                problem = check_block_scale(tuple(codes.shape), tuple(scale.shape), self.block)
                if problem is not None:
                    raise ConfigError(f"tensor '{prefix}.{which}{SCALE_SUFFIX}': {problem}")
                built.append(Fp8ExpertWeights(codes, scale.float(), self.block[0], self.block[1]))
                continue
            rows = shape[0] // len(projs)
            per_expert = [
                [
                    fp8_weight(
                        self.parts[(x, p)]["weight"],
                        self.parts[(x, p)][WEIGHT_SCALE],
                        self.block,
                        f"{prefix}.{x}.{p}_proj",
                        (rows, shape[1]),
                    )
                    for p in projs
                ]
                for x in range(e)
            ]
            built.append(Fp8ExpertWeights.stack(per_expert))
        self.parts, self.fused = {}, {}
        return built[0], built[1]
