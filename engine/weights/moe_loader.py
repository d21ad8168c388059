"""Checkpoint tensors of MoE blocks into `SparseMoeBlock`s: the router and shared-expert names,
and the experts in either layout (per expert `mlp.experts.{e}.{gate,up,down}_proj.*`, or fused
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]), in float, quantized to
NVFP4 per expert at load, packed NVFP4 (ModelOpt or compressed-tensors, per-expert tensors), or
block-wise FP8 kept as FP8 on GPUs with FP8 tensor cores (engine/weights/formats/fp8.py; elsewhere the loader
dequantizes FP8 experts before they get here, and they arrive as float)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.errors import ConfigError
from engine.models.moe import Experts, NVFP4Experts, SparseMoeBlock
from engine.weights.formats.fp8 import SCALE_SUFFIX, Fp8ExpertCollector, Fp8Format, is_fp8_linear
from engine.weights.formats.nvfp4 import (
    LINEAR_SUFFIXES,
    QuantizationMethod,
    is_packed,
    quantize_weight,
    tensor_roles,
    weight_from_tensors,
)
from kernels.fp8_dispatch import Fp8Experts
from kernels.fused_moe import NVFP4ExpertWeights
from kernels.nvfp4 import BLOCK_SIZE, NVFP4Weight

logger = logging.getLogger("fp4serve.loader")

_LINEAR = "(" + "|".join(LINEAR_SUFFIXES) + ")"
# Non-expert tensors of a MoE block: HF name after `model.layers.{i}.` -> (our path, shard).
_BLOCK_RULES: list[tuple[re.Pattern[str], str, int]] = [
    (re.compile(rf"mlp\.gate\.{_LINEAR}$"), "mlp.gate.{0}", 0),
    (re.compile(rf"mlp\.shared_expert\.gate_proj\.{_LINEAR}$"), "mlp.shared_expert.gate_up_proj.{0}", 0),
    (re.compile(rf"mlp\.shared_expert\.up_proj\.{_LINEAR}$"), "mlp.shared_expert.gate_up_proj.{0}", 1),
    (re.compile(rf"mlp\.shared_expert\.down_proj\.{_LINEAR}$"), "mlp.shared_expert.down_proj.{0}", 0),
    (re.compile(rf"mlp\.shared_expert_gate\.{_LINEAR}$"), "mlp.shared_expert_gate.{0}", 0),
]
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")
_PROJ_SLOT = {"gate": (0, 0), "up": (0, 1), "down": (1, 0)}  # -> (w13 | w2, shard)
_MIB = 1 << 20


def map_moe_name(rest: str) -> tuple[str, int] | None:
    """A MoE block's router / shared-expert tensor (name after `model.layers.{i}.`) -> (our path
    within the layer, shard), or None."""
    for pattern, target, shard in _BLOCK_RULES:
        m = pattern.search(rest)
        if m is not None:
            return target.format(*m.groups()), shard
    return None


def split_fused_experts(name: str, tensor: Tensor) -> dict[str, Tensor] | None:
    """A fused `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I] tensor as
    the per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` tensors; None for other names."""
    m = _FUSED.fullmatch(name)
    if m is None or tensor.dim() != 3:
        return None
    prefix = name.rpartition(".")[0]
    if m.group(2) == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    gate, up = tensor.chunk(2, dim=1)
    return {
        f"{prefix}.{e}.{proj}_proj.weight": w[e]
        for e in range(tensor.shape[0])
        for proj, w in (("gate", gate), ("up", up))
    }


class _UnloadedExperts(nn.Module):
    """Holds NVFP4 experts' place until every expert's tensors have streamed in."""

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        raise AssertionError("NVFP4 experts were used before the loader finished them")


@dataclass
class _BlockSlots:
    """One MoE block's experts as they arrive."""

    block: SparseMoeBlock
    num_experts: int
    intermediate: int
    hidden: int
    mode: str  # "float" | "quantize" | "packed" | "fp8"
    seen: set[tuple[int, str]] = field(default_factory=set)  # (expert, gate|up|down) float copies done
    weights: dict[tuple[int, str], NVFP4Weight] = field(default_factory=dict)
    parts: dict[tuple[int, str], dict[str, Tensor]] = field(default_factory=dict)
    fp8: Fp8ExpertCollector | None = None  # mode "fp8"


class ExpertLoader:
    """Claims expert tensors out of the checkpoint stream; `finish` checks nothing is missing and
    puts NVFP4 experts in place. Create it before the model is materialized (NVFP4 experts never
    allocate float storage)."""

    def __init__(
        self,
        model: nn.Module,
        tensor_names: set[str],
        method: QuantizationMethod | None,
        dtype: torch.dtype,
        device: torch.device,
        fp8: Fp8Format | None = None,
    ) -> None:
        """`fp8`: the checkpoint's FP8 format when FP8 experts stay FP8 on this device."""
        self.method = method
        self.dtype = dtype
        self.device = device
        self.slots: dict[int, _BlockSlots] = {}
        self.num_skipped = 0
        fmt = method.checkpoint_format if method is not None else None
        for path, module in model.named_modules():
            if not isinstance(module, SparseMoeBlock):
                continue
            layer = int(re.fullmatch(r"layers\.(\d+)\.mlp", path).group(1))  # type: ignore[union-attr]
            experts = module.experts
            assert isinstance(experts, Experts), f"{path}: experts already replaced"
            hidden = experts.w13.shape[2]
            prefix = f"model.layers.{layer}.mlp.experts.0.gate_proj"
            fused_fp8 = f"model.layers.{layer}.mlp.experts.gate_up_proj{SCALE_SUFFIX}" in tensor_names
            collector = None
            if fp8 is not None and (fused_fp8 or is_fp8_linear(tensor_names, prefix)):
                mode = "fp8"
                collector = Fp8ExpertCollector(fp8, experts.num_experts, experts.intermediate_size, hidden, device)
            elif method is None:
                mode = "float"
            elif fmt is None:
                mode = "quantize"
                for name, size in (("hidden_size", hidden), ("moe_intermediate_size", experts.intermediate_size)):
                    if size % BLOCK_SIZE:
                        raise ConfigError(
                            f"--quantization nvfp4: {name} = {size} is not a multiple of {BLOCK_SIZE} (the NVFP4 block)"
                        )
            else:
                mode = "packed" if is_packed(fmt, tensor_names, prefix) else "float"
            if mode != "float":
                module.experts = _UnloadedExperts()
            self.slots[layer] = _BlockSlots(
                module, experts.num_experts, experts.intermediate_size, hidden, mode, fp8=collector
            )

    def float_param_paths(self) -> set[str]:
        """Our parameter paths the generic loader must not expect (this loader fills them)."""
        return {
            f"layers.{layer}.mlp.experts.{w}"
            for layer, s in self.slots.items()
            if s.mode == "float"
            for w in ("w13", "w2")
        }

    def keeps_fp8(self, name: str) -> bool:
        """Whether `name` is an expert tensor of a block whose FP8 experts stay FP8 (the loader
        passes those through undequantized)."""
        m = _PER_EXPERT.fullmatch(name) or _FUSED.fullmatch(name)
        return m is not None and int(m.group(1)) in self.slots and self.slots[int(m.group(1))].mode == "fp8"

    def add(self, name: str, tensor: Tensor) -> bool:
        """True when `name` is an expert tensor (taken here), False for anything else."""
        m = _PER_EXPERT.fullmatch(name)
        if m is not None:
            layer, expert, proj, suffix = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            slots = self._slots(layer, name)
            if expert >= slots.num_experts:
                raise ConfigError(f"tensor '{name}': expert {expert} of a model with {slots.num_experts} experts")
            self._add_expert(slots, expert, proj, suffix, tensor, name)
            return True
        m = _FUSED.fullmatch(name)
        if m is not None:
            slots = self._slots(int(m.group(1)), name)
            if slots.fp8 is not None:
                slots.fp8.add_fused(m.group(2), m.group(3) is not None, tensor)
            elif m.group(3) is not None:
                raise ConfigError(f"tensor '{name}': an FP8 scale of experts that are not FP8 here")
            else:
                self._add_fused(slots, m.group(2), tensor, name)
            return True
        return False

    def _slots(self, layer: int, name: str) -> _BlockSlots:
        if layer not in self.slots:
            raise ConfigError(
                f"tensor '{name}': layer {layer} is not a MoE layer in config.json "
                "(see mlp_only_layers, decoder_sparse_step)"
            )
        return self.slots[layer]

    def _expected_shape(self, slots: _BlockSlots, proj: str) -> tuple[int, int]:
        return (slots.hidden, slots.intermediate) if proj == "down" else (slots.intermediate, slots.hidden)

    def _add_expert(self, slots: _BlockSlots, expert: int, proj: str, suffix: str, tensor: Tensor, name: str) -> None:
        key = (expert, proj)
        if slots.fp8 is not None:
            slots.fp8.add_expert(expert, proj, suffix, tensor, name)
            return
        if slots.mode == "packed":
            assert self.method is not None and self.method.checkpoint_format is not None
            needed, skipped = tensor_roles(self.method.checkpoint_format)
            if suffix in skipped:
                self.num_skipped += 1  # W4A4 activation scales: NVFP4 runs weight-only here
                return
            if suffix not in needed:
                raise ConfigError(f"tensor '{name}': unexpected for a {self.method.checkpoint_format} NVFP4 expert")
            parts = slots.parts.setdefault(key, {})
            parts[suffix] = tensor
            if len(parts) == len(needed):
                hf_module = name.rpartition(".")[0]
                weight = weight_from_tensors(self.method.checkpoint_format, parts, hf_module)
                if weight.shape != self._expected_shape(slots, proj):
                    raise ConfigError(
                        f"{hf_module}: NVFP4 weight of shape {list(weight.shape)}, expected "
                        f"{list(self._expected_shape(slots, proj))}"
                    )
                slots.weights[key] = weight.to(self.device)
                del slots.parts[key]
            return
        if suffix != "weight":
            raise ConfigError(f"tensor '{name}': experts here are float; expected only '.weight'")
        if tuple(tensor.shape) != self._expected_shape(slots, proj):
            raise ConfigError(
                f"tensor '{name}' has shape {list(tensor.shape)}, expected {list(self._expected_shape(slots, proj))}"
            )
        if slots.mode == "quantize":
            slots.weights[key] = quantize_weight(tensor.to(self.device), name)
            return
        which, shard = _PROJ_SLOT[proj]
        experts = slots.block.experts
        assert isinstance(experts, Experts)
        if which == 0:
            rows = slice(shard * slots.intermediate, (shard + 1) * slots.intermediate)
            experts.w13[expert, rows].copy_(tensor.to(self.dtype))
        else:
            experts.w2[expert].copy_(tensor.to(self.dtype))
        slots.seen.add(key)

    def _add_fused(self, slots: _BlockSlots, which: str, tensor: Tensor, name: str) -> None:
        e, i, h = slots.num_experts, slots.intermediate, slots.hidden
        expected = (e, 2 * i, h) if which == "gate_up_proj" else (e, h, i)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"tensor '{name}' has shape {list(tensor.shape)}, expected {list(expected)}")
        if slots.mode == "packed":
            raise ConfigError(
                f"tensor '{name}': a fused float expert tensor in an NVFP4 checkpoint whose "
                "experts are packed per expert"
            )
        projs = [("gate", slice(0, i)), ("up", slice(i, 2 * i))] if which == "gate_up_proj" else [("down", slice(None))]
        for expert in range(e):
            for proj, rows in projs:
                self._add_expert(slots, expert, proj, "weight", tensor[expert, rows], name)

    def finish(self) -> None:
        """Raise ConfigError naming the first missing expert tensor; build the NVFP4 experts."""
        fmt = self.method.checkpoint_format if self.method is not None else None
        for layer, slots in self.slots.items():
            if slots.fp8 is not None:
                prefix = f"model.layers.{layer}.mlp.experts"
                absent = slots.fp8.missing()
                if absent is not None:
                    raise ConfigError(f"missing tensor for '{prefix}.{absent}'")
                slots.block.experts = Fp8Experts(*slots.fp8.build(prefix))
                continue
            have = slots.seen if slots.mode == "float" else set(slots.weights)
            for expert in range(slots.num_experts):
                for proj in ("gate", "up", "down"):
                    if (expert, proj) not in have:
                        suffix = "weight" if fmt is None or slots.mode == "float" else tensor_roles(fmt)[0][0]
                        raise ConfigError(
                            f"missing tensor for 'model.layers.{layer}.mlp.experts.{expert}."
                            f"{proj}_proj.{suffix}' (or the fused mlp.experts.*_proj)"
                        )
            if slots.mode == "float":
                continue
            w13 = NVFP4ExpertWeights.stack(
                [[slots.weights[(e, "gate")], slots.weights[(e, "up")]] for e in range(slots.num_experts)]
            )
            w2 = NVFP4ExpertWeights.stack([[slots.weights[(e, "down")]] for e in range(slots.num_experts)])
            slots.weights.clear()
            slots.block.experts = NVFP4Experts(w13, w2)  # on the device already
        if self.slots:
            self._log()

    def _log(self) -> None:
        blocks = [s.block for s in self.slots.values()]
        nbytes = 0
        for block in blocks:
            experts = block.experts
            if isinstance(experts, (NVFP4Experts, Fp8Experts)):
                nbytes += experts.weight_nbytes
            else:
                assert isinstance(experts, Experts)
                nbytes += experts.w13.nbytes + experts.w2.nbytes
        first = next(iter(self.slots.values()))
        names = {"float": str(self.dtype).removeprefix("torch."), "fp8": "fp8 W8A8"}
        modes = sorted({names.get(s.mode, "nvfp4") for s in self.slots.values()})
        logger.info(
            "moe: %d sparse layers x %d experts (%d active per token); experts resident %.2f MiB (%s)",
            len(blocks),
            first.num_experts,
            first.block.top_k,
            nbytes / _MIB,
            "/".join(modes),
        )
        if self.num_skipped:
            logger.info("skipped %d W4A4 expert activation scales: weight-only NVFP4", self.num_skipped)
