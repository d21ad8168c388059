"""The safetensors files of a local HF checkpoint folder (one file or a sharded index): which
files, every tensor name (read from the headers only), and the tensors one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ConfigError


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{index}: shard {f.name} not found")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights found")
    return files


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name in the checkpoint, read from the safetensors headers only."""
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(path)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
