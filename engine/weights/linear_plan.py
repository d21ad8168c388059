"""Which of the model's linears are built from their checkpoint tensors by a builder rather than
copied as float weights: NVFP4 packed in the checkpoint or quantized at load, int8 or int4 at load, or
block-wise FP8 kept as FP8 (engine/weights/formats/fp8.py); the placeholders that hold their places meanwhile, and
our parameter paths back to the checkpoint's names for messages."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ConfigError
from engine.models.decoder import DecoderForCausalLM
from engine.models.layers import Linear
from engine.weights.formats.fp8 import Fp8Format, Fp8LinearBuilder, is_fp8_linear
from engine.weights.formats.int4_linear import Int4LinearBuilder
from engine.weights.formats.int8_linear import Int8LinearBuilder
from engine.weights.formats.nvfp4 import (
    CPU_SCHEMES,
    INT4,
    INT8,
    NVFP4LinearBuilder,
    QuantizationMethod,
    check_quantizable,
    is_packed,
    is_quantizable,
)
from engine.weights.qwen3_5_names import FUSED_LINEARS

LinearBuilder = NVFP4LinearBuilder | Int8LinearBuilder | Int4LinearBuilder | Fp8LinearBuilder
# Linears an FP8 checkpoint may store in FP8 that stay float here: the router's softmax picks
# experts (W8A8 would re-rank near ties) and the head scores every token.
_FP8_FLOAT = ("lm_head", ".mlp.gate", ".shared_expert_gate")


class Unloaded(nn.Module):
    """Holds a built linear's place until its shards have all streamed in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a quantized linear was used before the loader finished it")


def plan_linears(
    model: DecoderForCausalLM,
    names: set[str],
    method: QuantizationMethod | None,
    dtype: torch.dtype,
    device: torch.device,
    fp8: Fp8Format | None = None,
) -> dict[str, LinearBuilder]:
    """Builders by module path. A packed NVFP4 checkpoint: the linears whose tensors say so (exclude
    lists vary between producers; the tensors do not lie); at load (NVFP4, int8 or int4): q/k/v/o,
    gate/up/down; `fp8` (FP8 kept on this device): the linears stored with block scales."""
    cfg = model.config
    if method is not None and method.quantize_at_load and method.scheme not in CPU_SCHEMES:
        check_quantizable(cfg, "--quantization nvfp4")
    plan: dict[str, LinearBuilder] = {}
    for module_path, module in model.named_modules():
        if not isinstance(module, Linear) or (module_path == "lm_head" and cfg.tie_word_embeddings):
            continue
        hf = [hf_name(f"{module_path}.weight", i).removesuffix(".weight") for i in range(len(module.shard_sizes))]
        bias = None
        if module.bias is not None:
            bias = torch.zeros(sum(module.shard_sizes), dtype=dtype, device=device)  # [N]
        if fp8 is not None and not module_path.endswith(_FP8_FLOAT):
            flags = [is_fp8_linear(names, h) for h in hf]
            if all(flags):  # shards of mixed formats are dequantized, so any mix works
                plan[module_path] = Fp8LinearBuilder(fp8, hf, module.shard_sizes, module.in_features, bias, device)
                continue
        if method is None:
            continue
        fmt = method.checkpoint_format
        flags = [is_quantizable(h) if fmt is None else is_packed(fmt, names, h) for h in hf]
        if any(flags) and not all(flags):
            raise ConfigError(
                f"{hf[flags.index(True)]} is NVFP4 but {hf[flags.index(False)]} is not; "
                f"the linears fused into {module_path} need one format"
            )
        if not all(flags):
            continue
        if method.scheme == INT8:
            plan[module_path] = Int8LinearBuilder(hf, module.shard_sizes, module.in_features, bias, dtype, device)
        elif method.scheme == INT4:
            plan[module_path] = Int4LinearBuilder(
                hf, module.shard_sizes, module.in_features, bias, dtype, device, method.int8_dense_from_rows
            )
        else:
            plan[module_path] = NVFP4LinearBuilder(method, hf, module.shard_sizes, module.in_features, bias, device)
    return plan


def hf_name(pname: str, shard: int | None) -> str:
    """Our parameter path back to the checkpoint's tensor name, for error messages."""
    fused = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        **FUSED_LINEARS,
    }
    name = pname
    for ours, theirs in fused.items():
        if ours in name and shard is not None:
            name = name.replace(ours, theirs[shard])
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        name = "model." + name
    return name
