"""Checks and copies every weight builder shares (NVFP4 in engine/weights/formats/nvfp4.py, int8 and
int4 in engine/weights/formats/int8_linear.py and int4_linear.py, FP8 in engine/weights/formats/fp8.py):
a checkpoint tensor's shape against what config.json implies, a fused linear's bias rows, and the
shard bookkeeping of the builders that quantize float weights at load. Its own module so those
builders need not import each other."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.errors import ConfigError


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
    bias[start : start + rows].copy_(tensor.to(bias.dtype))


class FloatQuantizingBuilder:
    """One linear quantized at load (its shards fused: q/k/v, gate/up) from float checkpoint tensors
    that stream in any order. A subclass names its `scheme` (the --quantization value) and quantizes
    one shard's weight in `quantize`; `complete_shards` gives them all once every one has arrived."""

    scheme = ""

    def __init__(
        self,
        hf_modules: list[str],
        shard_sizes: list[int],
        in_features: int,
        bias: Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert len(hf_modules) == len(shard_sizes), "one checkpoint linear per shard"
        self.hf_modules = hf_modules  # per shard, e.g. model.layers.0.self_attn.q_proj
        self.shard_sizes = shard_sizes
        self.in_features = in_features
        self.bias = bias  # [N] model dtype on `device`, filled shard by shard; None: no bias
        self.dtype = dtype
        self.device = device
        self.shards: list[Any] = [None] * len(shard_sizes)  # what `quantize` returned, per shard

    def quantize(self, shard: int, weight: Tensor) -> Any:
        raise NotImplementedError

    def add(self, shard: int, suffix: str, tensor: Tensor) -> None:
        hf_module, rows = self.hf_modules[shard], self.shard_sizes[shard]
        if suffix == "bias":
            copy_bias_shard(self.bias, hf_module, self.shard_sizes, shard, tensor)
            return
        if suffix != "weight":
            raise ConfigError(
                f"tensor '{hf_module}.{suffix}' is a quantization tensor; --quantization {self.scheme} "
                "quantizes float checkpoints only"
            )
        check_shape(f"{hf_module}.weight", tensor.shape, (rows, self.in_features))
        # The stored values are quantized (not a copy cast to the model dtype first).
        self.shards[shard] = self.quantize(shard, tensor.to(self.device))

    def complete_shards(self) -> list[Any]:
        for hf_module, got in zip(self.hf_modules, self.shards):
            if got is None:
                raise ConfigError(f"missing tensor for '{hf_module}.weight'")
        return self.shards
