"""Checkpoint names of Qwen3.5 / Qwen3.6 hybrids: ConditionalGeneration checkpoints keep the text
model under model.language_model.* (beside model.visual.* and mtp.*), CausalLM ones under model.*.
`canonical_name` brings both to model.*; `LINEAR_ATTN_RULES` map the DeltaNet tensors onto our
fused linears (in_proj_qkv + in_proj_z, in_proj_b + in_proj_a)."""

from __future__ import annotations

import re

from engine.weights.formats.nvfp4 import LINEAR_SUFFIXES

_LINEAR = "(" + "|".join(LINEAR_SUFFIXES) + ")"
_TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."

# HF tensor name (after "model.layers.N.") -> (our parameter path, shard within a fused Linear or None)
LINEAR_ATTN_RULES: list[tuple[re.Pattern[str], str, int | None]] = [
    (re.compile(rf"linear_attn\.in_proj_qkv\.{_LINEAR}$"), "linear_attn.in_proj_qkvz.{0}", 0),
    (re.compile(rf"linear_attn\.in_proj_z\.{_LINEAR}$"), "linear_attn.in_proj_qkvz.{0}", 1),
    (re.compile(rf"linear_attn\.in_proj_b\.{_LINEAR}$"), "linear_attn.in_proj_ba.{0}", 0),
    (re.compile(rf"linear_attn\.in_proj_a\.{_LINEAR}$"), "linear_attn.in_proj_ba.{0}", 1),
    (re.compile(rf"linear_attn\.out_proj\.{_LINEAR}$"), "linear_attn.out_proj.{0}", 0),
    (re.compile(r"linear_attn\.conv1d\.weight$"), "linear_attn.conv1d.weight", None),
    (re.compile(r"linear_attn\.dt_bias$"), "linear_attn.dt_bias", None),
    (re.compile(r"linear_attn\.A_log$"), "linear_attn.A_log", None),
    (re.compile(r"linear_attn\.norm\.weight$"), "linear_attn.norm.weight", None),
]
# Our fused linears -> the checkpoint's modules, shard by shard (for names in messages and NVFP4).
FUSED_LINEARS = {
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}


def canonical_name(name: str) -> str:
    """model.language_model.X -> model.X; every other name unchanged."""
    return "model." + name.removeprefix(_TEXT_PREFIX) if name.startswith(_TEXT_PREFIX) else name


def skipped_part(name: str) -> str | None:
    """'vision' or 'mtp' for tensors a text server leaves out; None for the rest."""
    if name.startswith(VISION_PREFIX):
        return "vision"
    if name.startswith(MTP_PREFIX):
        return "mtp"
    return None
