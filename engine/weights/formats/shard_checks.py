"""Checks and copies every weight builder shares (NVFP4 in engine/weights/formats/nvfp4.py, int8 in
engine/weights/formats/int8_linear.py, FP8 in engine/weights/formats/fp8.py): a checkpoint tensor's shape against what config.json
implies, and a fused linear's bias rows. Its own module so those builders need not import each
other."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.config import ConfigError


def check_shape(name: str, shape: torch.Size, expected: tuple[int, ...]) -> None:
    if tuple(shape) != expected:
        raise ConfigError(f"tensor '{name}' has shape {list(shape)}, expected {list(expected)}")


def copy_bias_shard(bias: Tensor | None, hf_module: str, shard_sizes: list[int], shard: int, tensor: Tensor) -> None:
    """A fused linear's bias rows for shard `shard` (checkpoint linear `hf_module`), checked and
    copied into `bias` ([sum(shard_sizes)], None when config.json declares no bias)."""
    rows = shard_sizes[shard]
    if bias is None:
        raise ConfigError(f"tensor '{hf_module}.bias' exists, but config.json declares no bias")
    check_shape(f"{hf_module}.bias", tensor.shape, (rows,))
    start = sum(shard_sizes[:shard])
    bias[start:start + rows].copy_(tensor.to(bias.dtype))
