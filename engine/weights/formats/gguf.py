"""GGUF files as HF checkpoint folders. The `gguf` package reads and dequantizes the tensors and
transformers' GGUF support builds the tokenizer (chat template included) and, for llama and
qwen3, the config; ours (engine/weights/formats/gguf_arch.py) is each architecture's tensor-name map, llama.cpp's
value transforms undone, the config of the MoE and hybrid architectures, and a folder written
once under the cache root, shard by shard, so later starts load it in seconds."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.errors import ConfigError
from engine.host.cache_folder import build_once, cache_root, is_complete
from engine.weights.formats.gguf_arch import GGUF_ARCHITECTURES, OWN_CONFIG, own_config, tensor_map
from engine.weights.formats.gguf_arch import (
    unpermute_qk as unpermute_qk,  # re-exported: tests and tools import it from here
)

logger = logging.getLogger("fp4serve.gguf")

# GGUF `general.architecture` -> the HF architecture our loader serves
SUPPORTED_GGUF_ARCHITECTURES = {arch: hf for arch, (hf, _) in GGUF_ARCHITECTURES.items()}
CONVERTER_VERSION = 2  # bump whenever the written folder changes, so old cache entries are rebuilt
FLOAT32_MAX_PARAMS = 2_000_000_000  # above this the folder is written in bfloat16 (half the disk)
_SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class GGUFSummary:
    """What start-up checks before converting: one line of error names the first problem."""

    architecture: str  # GGUF's general.architecture, e.g. "llama"
    name: str  # general.name, or the file stem
    num_params: int
    tensor_types: dict[str, int]  # quant type name -> number of tensors
    config: dict[str, Any]  # the HF config.json to write


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


def inspect_gguf(path: Path, reader: Any = None) -> GGUFSummary:
    """Fail here, before any conversion, on an architecture, quant type or feature we do not serve.
    `reader`: the file's GGUFReader when the caller has one (parsing the metadata takes seconds on a
    file with a 49k-token vocabulary)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = reader if reader is not None else _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture '{arch}'; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{path}: unsupported GGUF rope scaling '{scaling}' ({arch}.rope.scaling.type)")
    config = _hf_config(path, reader, arch)
    names = tensor_map(arch, config)
    types: dict[str, int] = {}
    checked: set[GGMLQuantizationType] = set()
    num_params = 0
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ConfigError(f"{path}: unsupported GGUF tensor rope_freqs.weight (Llama 3.1 rope scaling)")
        if not names.known(tensor.name):
            raise ConfigError(f"{path}: unsupported GGUF tensor '{tensor.name}' for architecture '{arch}'")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in checked:  # dequantize one row: the gguf package raises for types it lacks
            try:
                dequantize(tensor.data.reshape(-1, tensor.data.shape[-1])[:1], qtype)
            except NotImplementedError:
                raise ConfigError(f"{path}: unsupported GGUF quant type {qtype.name} (tensor {tensor.name})") from None
            checked.add(qtype)
        types[qtype.name] = types.get(qtype.name, 0) + 1
        num_params += int(tensor.n_elements)
    name = _field(reader, "general.name") or path.stem
    return GGUFSummary(architecture=arch, name=str(name), num_params=num_params, tensor_types=types, config=config)


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
    reader = _reader(path)
    summary = inspect_gguf(path, reader)
    types = ", ".join(f"{n} {k}" for k, n in sorted(summary.tensor_types.items()))
    logger.info(
        "converting GGUF %s (%s, %s, %.0fM parameters; %s) into %s (first use only)",
        path.name,
        summary.name,
        summary.architecture,
        summary.num_params / 1e6,
        types,
        final,
    )
    started = time.monotonic()
    build_once(final, lambda staging: convert_gguf(path, staging, summary, reader))
    logger.info("GGUF converted in %.1f s", time.monotonic() - started)
    return final


def convert_gguf(path: Path, dst: Path, summary: GGUFSummary | None = None, reader: Any = None) -> None:
    """Write `dst` (an existing empty folder) as an HF checkpoint: config, generation config,
    dequantized safetensors (each shard written when full), tokenizer with the GGUF's chat template.
    `summary` and `reader`: inspect_gguf's, when the caller has them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = reader if reader is not None else _reader(path)
    summary = summary or inspect_gguf(path, reader)
    dtype = torch.float32 if summary.num_params <= FLOAT32_MAX_PARAMS else torch.bfloat16
    config = {**summary.config, "torch_dtype": str(dtype).removeprefix("torch.")}
    _write_json(dst / "config.json", config)
    _write_json(dst / "generation_config.json", _generation_config(config, reader))
    names = tensor_map(summary.architecture, config)
    shards = _ShardWriter(dst)
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        weight = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))  # numpy float32
        for name, value in names.convert(tensor.name, weight):
            shards.add(name, value.to(dtype))
    shards.close()
    _write_tokenizer(path, dst)


def _hf_config(path: Path, reader: Any, arch: str) -> dict[str, Any]:
    """config.json: transformers' reading of the metadata for llama / qwen3, ours for the MoE and
    hybrid architectures (engine/weights/formats/gguf_arch.py)."""
    if arch in OWN_CONFIG:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
        try:
            shapes = {
                t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors
            }  # GGUF lists dims reversed
            config = own_config(arch, lambda key: _field(reader, f"{arch}.{key}"), shapes, int(vocab or 0))
        except KeyError as e:
            raise ConfigError(f"{path}: GGUF metadata key {e} is missing (a {arch} model needs it)") from None
        config["bos_token_id"] = _field(reader, "tokenizer.ggml.bos_token_id")
        config["eos_token_id"] = _field(reader, "tokenizer.ggml.eos_token_id")
        return config
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    raw = load_gguf_checkpoint(str(path))["config"]
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    config["architectures"] = [SUPPORTED_GGUF_ARCHITECTURES[arch]]
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


class _ShardWriter:
    """safetensors files of at most _SHARD_BYTES, each written as soon as it is full, so the
    conversion holds one shard in memory, not the model."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.current: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        if self.nbytes + value.nbytes > _SHARD_BYTES and self.current:
            self._flush()
        self.current[name] = value
        self.nbytes += value.nbytes

    def _flush(self) -> None:
        file = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.current, str(self.dst / file), metadata={"format": "pt"})
        self.files.append(file)
        self.weight_map.update(dict.fromkeys(self.current, file))
        self.current, self.nbytes = {}, 0

    def close(self) -> None:
        if not self.files:  # one shard: the usual single model.safetensors
            save_file(self.current, str(self.dst / "model.safetensors"), metadata={"format": "pt"})
            return
        if self.current:
            self._flush()
        _write_json(self.dst / "model.safetensors.index.json", {"metadata": {}, "weight_map": self.weight_map})


def _write_tokenizer(path: Path, dst: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as first:  # transformers raises many types for a tokenizer it cannot convert
        # NOTE: AutoTokenizer reads the model config too, which older transformers cannot for the
        # hybrid architectures; the fast tokenizer class reads the tokenizer keys only.
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception:
            raise ConfigError(
                f"{path}: cannot build the tokenizer from the GGUF metadata ({type(first).__name__}: {first})"
            ) from None
    tokenizer.save_pretrained(str(dst))


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
