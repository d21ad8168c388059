"""Weights from a local HF checkpoint (one safetensors file or a sharded index) straight into
our modules. A missing or mis-shaped tensor fails start-up with one line naming it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import ConfigError, ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.layers import Linear

logger = logging.getLogger("fp4serve.loader")

# HF tensor name -> (our parameter path, shard index within a fused Linear or None)
_LAYER_RULES: list[tuple[re.Pattern[str], str, int | None]] = [
    (re.compile(r"self_attn\.q_proj\.(weight|bias)$"), "self_attn.qkv_proj.{0}", 0),
    (re.compile(r"self_attn\.k_proj\.(weight|bias)$"), "self_attn.qkv_proj.{0}", 1),
    (re.compile(r"self_attn\.v_proj\.(weight|bias)$"), "self_attn.qkv_proj.{0}", 2),
    (re.compile(r"self_attn\.o_proj\.(weight|bias)$"), "self_attn.o_proj.{0}", 0),
    (re.compile(r"mlp\.gate_proj\.(weight|bias)$"), "mlp.gate_up_proj.{0}", 0),
    (re.compile(r"mlp\.up_proj\.(weight|bias)$"), "mlp.gate_up_proj.{0}", 1),
    (re.compile(r"mlp\.down_proj\.(weight|bias)$"), "mlp.down_proj.{0}", 0),
    (re.compile(r"self_attn\.q_norm\.weight$"), "self_attn.q_norm.weight", None),
    (re.compile(r"self_attn\.k_norm\.weight$"), "self_attn.k_norm.weight", None),
    (re.compile(r"input_layernorm\.weight$"), "input_layernorm.weight", None),
    (re.compile(r"post_attention_layernorm\.weight$"), "post_attention_layernorm.weight", None),
]
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


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


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(path)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def map_name(name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter path, shard) or None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", 0
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m is None or _IGNORED.search(name):
        return None
    layer, rest = m.group(1), m.group(2)
    for pattern, target, shard in _LAYER_RULES:
        pm = pattern.search(rest)
        if pm is not None:
            return f"layers.{layer}." + target.format(*pm.groups()), shard
    return None


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int) -> DecoderForCausalLM:
    # Built directly in the target dtype and device: no float32 copy of a big model.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(cfg, max_len)
    finally:
        torch.set_default_dtype(default_dtype)
    assert model.rotary.cos.dtype == torch.float32, "cos/sin tables stay float32, cast at use"
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    expected: set[tuple[str, int | None]] = set()
    for pname, _ in params.items():
        module_path, _, leaf = pname.rpartition(".")
        module = modules[module_path]
        if isinstance(module, Linear):
            if pname == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            expected.update((pname, i) for i in range(len(module.shard_sizes)))
        else:
            expected.add((pname, None))

    seen: set[tuple[str, int | None]] = set()
    unused: list[str] = []
    files = checkpoint_files(path)
    total = sum(len(safe_open(str(f), framework="pt").keys()) for f in files)
    with torch.no_grad():
        for name, tensor in tqdm(iter_checkpoint(path), total=total, desc="loading weights", unit="tensor", disable=None):
            mapped = map_name(name)
            if mapped is None or (mapped[0] == "lm_head.weight" and cfg.tie_word_embeddings):
                unused.append(name)
                continue
            pname, shard = mapped
            if pname not in params:
                raise ConfigError(f"{path}: tensor '{name}' does not fit this model's configuration")
            param = params[pname]
            target = param
            if shard is not None:
                module = modules[pname.rpartition(".")[0]]
                assert isinstance(module, Linear)
                target = param[module.shard_slice(shard)]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}, expected {list(target.shape)}")
            target.copy_(tensor.to(dtype))
            seen.add((pname, shard))
    missing = sorted(expected - seen, key=str)
    if missing:
        pname, shard = missing[0]
        raise ConfigError(f"{path}: missing tensor for '{_hf_name(pname, shard)}' ({len(missing)} missing in all)")
    if unused:
        logger.warning("ignored %d checkpoint tensors (e.g. %s)", len(unused), unused[0])
    return model.eval()


def _hf_name(pname: str, shard: int | None) -> str:
    """Our parameter path back to the checkpoint's tensor name, for error messages."""
    fused = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    name = pname
    for ours, theirs in fused.items():
        if ours in name and shard is not None:
            name = name.replace(ours, theirs[shard])
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        name = "model." + name
    return name
