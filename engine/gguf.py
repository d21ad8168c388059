"""GGUF files as HF checkpoint folders. The `gguf` package reads and dequantizes the tensors and
transformers' GGUF support reads the config and builds the tokenizer (chat template included);
ours is the tensor-name map, llama.cpp's q/k row order undone, and a folder written once under
the cache root, so later starts load it in seconds."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.cache_folder import build_once, cache_root, is_complete
from engine.config import ConfigError

logger = logging.getLogger("fp4serve.gguf")

# GGUF `general.architecture` -> the HF architecture our loader serves
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONVERTER_VERSION = 1  # bump whenever the written folder changes, so old cache entries are rebuilt
FLOAT32_MAX_PARAMS = 2_000_000_000  # above this the folder is written in bfloat16 (half the disk)
_SHARD_BYTES = 2 << 30

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFSummary:
    """What start-up checks before converting: one line of error names the first problem."""

    architecture: str  # GGUF's general.architecture, e.g. "llama"
    name: str  # general.name, or the file stem
    num_params: int
    tensor_types: dict[str, int]  # quant type name -> number of tensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown names."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's llama q/k row order (it interleaves each head's two rotary halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError... on a bad file
        raise ConfigError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def inspect_gguf(path: Path) -> GGUFSummary:
    """Fail here, before any conversion, on an architecture, quant type or feature we do not serve."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture '{arch}'; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{path}: unsupported GGUF rope scaling '{scaling}' ({arch}.rope.scaling.type)")
    types: dict[str, int] = {}
    checked: set[GGMLQuantizationType] = set()
    num_params = 0
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ConfigError(f"{path}: unsupported GGUF tensor rope_freqs.weight (Llama 3.1 rope scaling)")
        if hf_tensor_name(tensor.name) is None:
            raise ConfigError(f"{path}: unsupported GGUF tensor '{tensor.name}' for architecture '{arch}'")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in checked:  # dequantize one row: the gguf package raises for types it lacks
            try:
                dequantize(tensor.data.reshape(-1, tensor.data.shape[-1])[:1], qtype)
            except NotImplementedError:
                raise ConfigError(
                    f"{path}: unsupported GGUF quant type {qtype.name} (tensor {tensor.name})"
                ) from None
            checked.add(qtype)
        types[qtype.name] = types.get(qtype.name, 0) + 1
        num_params += int(tensor.n_elements)
    name = _field(reader, "general.name") or path.stem
    return GGUFSummary(architecture=arch, name=str(name), num_params=num_params, tensor_types=types)


def gguf_cache_folder(path: Path, root: Path | None = None) -> Path:
    """The cache folder for this file: keyed by its resolved path, size and mtime (hashing a
    multi-GB file at every start would cost more than the load)."""
    path = path.resolve()
    stat = path.stat()
    key = f"{CONVERTER_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (root if root is not None else cache_root()) / "gguf" / f"{path.stem}-{digest}"


def ensure_gguf_checkpoint(path: Path, root: Path | None = None) -> Path:
    """The HF folder for GGUF file `path`, converted on first use."""
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such file")
    final = gguf_cache_folder(path, root)
    if is_complete(final):
        logger.info("GGUF %s: converted copy at %s", path.name, final)
        return final
    summary = inspect_gguf(path)
    types = ", ".join(f"{n} {k}" for k, n in sorted(summary.tensor_types.items()))
    logger.info("converting GGUF %s (%s, %s, %.0fM parameters; %s) into %s (first use only)",
                path.name, summary.name, summary.architecture, summary.num_params / 1e6, types, final)
    started = time.monotonic()
    build_once(final, lambda staging: convert_gguf(path, staging, summary))
    logger.info("GGUF converted in %.1f s", time.monotonic() - started)
    return final


def convert_gguf(path: Path, dst: Path, summary: GGUFSummary | None = None) -> None:
    """Write `dst` (an existing empty folder) as an HF checkpoint: config, generation config,
    dequantized safetensors, tokenizer with the GGUF's chat template."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    summary = summary or inspect_gguf(path)
    dtype = torch.float32 if summary.num_params <= FLOAT32_MAX_PARAMS else torch.bfloat16
    reader = _reader(path)
    config = _hf_config(load_gguf_checkpoint(str(path))["config"], reader, summary.architecture, dtype)
    _write_json(dst / "config.json", config)
    _write_json(dst / "generation_config.json", _generation_config(config, reader))
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        name = hf_tensor_name(tensor.name)
        assert name is not None, f"inspect_gguf let {tensor.name} through"
        weight = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))  # numpy float32
        if summary.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = unpermute_qk(weight, num_heads if "q_proj" in name else num_kv_heads)
        value = torch.from_numpy(np.require(weight, requirements=["C", "W"])).to(dtype)
        if shard_bytes + value.nbytes > _SHARD_BYTES and shards[-1]:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = value
        shard_bytes += value.nbytes
    _write_shards(dst, shards)
    _write_tokenizer(path, dst)


def _hf_config(raw: dict[str, Any], reader: Any, arch: str, dtype: torch.dtype) -> dict[str, Any]:
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    config["architectures"] = [SUPPORTED_GGUF_ARCHITECTURES[arch]]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if config.get("head_dim") is None:  # qwen3 GGUFs give it as the attention key length
        key_length = _field(reader, f"{arch}.attention.key_length")
        config["head_dim"] = int(key_length) if key_length else config["hidden_size"] // config["num_attention_heads"]
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.pop("quantization_config", None)
    return config


def _generation_config(config: dict[str, Any], reader: Any) -> dict[str, Any]:
    eos = [config.get("eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    ids = [int(i) for i in dict.fromkeys(eos) if i is not None]
    return {"bos_token_id": config.get("bos_token_id"), "eos_token_id": ids, "do_sample": False}


def _write_shards(dst: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    _write_json(dst / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _write_tokenizer(path: Path, dst: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for a tokenizer it cannot convert
        raise ConfigError(f"{path}: cannot build the tokenizer from the GGUF metadata ({type(e).__name__}: {e})") from None
    tokenizer.save_pretrained(str(dst))


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
