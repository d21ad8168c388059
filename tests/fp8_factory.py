"""Block-wise FP8 copies of tiny float checkpoints, written the way Qwen's FP8 releases are
(Qwen3-Coder-30B-A3B-Instruct-FP8, Qwen3.6-27B-FP8, Qwen3.6-35B-A3B-FP8): each quantized linear's
`weight` as float8_e4m3fn codes and `weight_scale_inv` [ceil(N/128), ceil(K/128)] float32, each
128x128 block scaled by its amax / 448; routers, shared-expert gates, in_proj_a/b, lm_head,
embeddings, norms, conv1d and the vision tower left as they were; `quantization_config` as the
releases declare it. Written independently of engine/ and kernels/ (explicit loops over blocks),
so the loader's dequantization is checked against a separate implementation.

`dequantized_copy` writes the float checkpoint transformers then serves as the reference: every
FP8 weight replaced by codes * scale computed in float32."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (128, 128)
FP8_MAX = 448.0
# The linears Qwen's FP8 releases store in FP8 (after model. / model.language_model. / mtp.).
_QUANTIZED = re.compile(
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj"
    r"|mlp\.shared_expert\.(gate|up|down)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))"
    r"\.weight$"
)
_FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
NOT_CONVERTED = [
    "lm_head",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "model.visual",
    "mtp.fc",
]


def block_quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (float8_e4m3fn codes, float32 scale grid [..., ceil(N/bn), ceil(K/bk)])."""
    w = weight.float()
    *lead, n, k = w.shape
    bn, bk = block
    scale = torch.ones(*lead, -(-n // bn), -(-k // bk), dtype=torch.float32)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            blk = w[..., i : i + bn, j : j + bk]
            amax = blk.abs().amax(dim=(-2, -1))
            s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            scale[..., i // bn, j // bk] = s
            codes[..., i : i + bn, j : j + bk] = (blk / s[..., None, None]).to(torch.float8_e4m3fn)
    return codes, scale


def block_dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The float32 weight: every element's code times its block's scale."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    n, k = codes.shape[-2:]
    bn, bk = block
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            out[..., i : i + bn, j : j + bk] = (
                codes[..., i : i + bn, j : j + bk].float() * scale[..., i // bn, j // bk, None, None]
            )
    return out


def _text_name(name: str) -> str:
    for prefix in ("model.language_model.", "model.", "mtp."):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def to_fp8_checkpoint(src: Path, dst: Path, fused_experts: bool = False) -> Path:
    """An FP8 copy of `src` at `dst`. `fused_experts`: MoE experts written fused
    (`mlp.experts.gate_up_proj` [E, 2I, H] with `gate_up_proj_scale_inv`, `down_proj` likewise),
    the layout transformers' own FP8 quantizer saves; else per expert, as Qwen's releases are."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if fused_experts:
        tensors = _fuse_experts(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        base = _text_name(name)
        if _QUANTIZED.search(base) or (_FUSED.search(base) and value.dim() == 3):
            codes, scale = block_quantize(value)
            out[name] = codes
            out[
                name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"
            ] = scale
        else:
            out[name] = value
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": NOT_CONVERTED,
    }
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return dst


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    per = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    rest = {}
    for name, value in tensors.items():
        m = per.fullmatch(name)
        if m is None:
            rest[name] = value
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
    for prefix, parts in groups.items():
        num = 1 + max(e for e, _ in parts)
        rest[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(num)]
        )
        rest[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(num)])
    return rest


def dequantized_copy(fp8: Path, dst: Path) -> Path:
    """A float32 checkpoint of `fp8`'s dequantized weights (fused experts written per expert, as
    transformers' save_pretrained writes them), without quantization_config: the reference."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in fp8.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    tensors = load_file(str(fp8 / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale_name = (
            name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"
        )
        if value.dtype != torch.float8_e4m3fn:
            out[name] = value
            continue
        w = block_dequantize(value, tensors[scale_name])
        fused = _FUSED.search(name)
        if fused is None:
            out[name] = w
            continue
        prefix = name.rpartition(".")[0]
        for e in range(w.shape[0]):
            if fused.group(1) == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w[e].clone()
            else:
                gate, up = w[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate.clone(), up.clone()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return dst
