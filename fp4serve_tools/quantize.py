"""`fp4serve quantize SRC DST`: write an NVFP4 copy of a float HF checkpoint in the ModelOpt or
compressed-tensors layout (q/k/v/o and gate/up/down quantized, MoE experts one by one; one tensor
set per HF linear; lm_head, embeddings, norms and MoE routers unchanged), with its config,
tokenizer and generation files. A block-wise FP8 source (Qwen's FP8 releases) is dequantized
tensor by tensor first (engine/weights/formats/fp8.py)."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.errors import ConfigError
from engine.weights.checkpoint_files import checkpoint_files, tensor_names
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.fp8 import Fp8Dequantizer, Fp8Format, fp8_format
from engine.weights.formats.nvfp4 import (
    CHECKPOINT_FORMATS,
    HF_QUANT_CONFIG,
    MODELOPT,
    check_quantizable,
    checkpoint_quantization_config,
    detect_quantization,
    hf_quant_config,
    is_quantizable,
    quantize_weight,
    weight_to_tensors,
)
from engine.weights.moe_loader import split_fused_experts
from engine.weights.qwen3_5_names import canonical_name

logger = logging.getLogger("fp4serve.quantize")

INDEX_FILE = "model.safetensors.index.json"
# Everything else at the top of SRC is copied (tokenizer, chat template, generation config,
# license, README), except other weight formats that would contradict the new tensors.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_REWRITTEN = ("config.json", HF_QUANT_CONFIG, INDEX_FILE)
_EXCLUDED = ["lm_head"]  # written into the quantization config: what stays in float
_MIB = 1 << 20


@dataclass(frozen=True)
class QuantizeReport:
    bytes_before: int  # every weight tensor of SRC as stored
    bytes_after: int  # every weight tensor written to DST
    linear_bytes_before: int  # of which the quantized linears
    linear_bytes_after: int
    num_quantized: int  # HF linears written as NVFP4

    def summary(self) -> str:
        return (
            f"weights: {self.bytes_before / _MIB:.2f} MiB -> {self.bytes_after / _MIB:.2f} MiB "
            f"(quantized linears: {self.linear_bytes_before / _MIB:.2f} MiB -> "
            f"{self.linear_bytes_after / _MIB:.2f} MiB, {self.num_quantized} linears)"
        )


def quantize_checkpoint(
    src: Path, dst: Path, checkpoint_format: str, device: torch.device, producer_version: str = "0"
) -> QuantizeReport:
    """Write the NVFP4 checkpoint. DST must not exist or be empty; it appears only when complete.

    Raises ConfigError (one line) for a source that cannot be quantized."""
    assert checkpoint_format in CHECKPOINT_FORMATS, f"unknown format {checkpoint_format}"
    cfg = ModelConfig.from_checkpoint(src)
    if detect_quantization(src, cfg.quantization, None) is not None:
        raise ConfigError(f"{src}: already quantized (config.json quantization_config or {HF_QUANT_CONFIG})")
    check_quantizable(cfg, f"{src}/config.json")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"{dst}: exists and is not an empty folder")
    files = checkpoint_files(src)
    fp8 = fp8_format(cfg.quantization)
    # NOTE: written into a sibling folder renamed at the end, so a failed or interrupted run never
    # leaves a DST that looks like a checkpoint.
    partial = dst.with_name(f".{dst.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        report, weight_map = _write_tensors(src, files, partial, checkpoint_format, device, fp8)
        _write_configs(
            src,
            partial,
            checkpoint_format,
            producer_version,
            weight_map,
            report.bytes_after,
            sharded=(src / INDEX_FILE).is_file(),
        )
        _copy_other_files(src, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # empty, checked above
    partial.rename(dst)
    return report


def _write_tensors(
    src: Path, files: list[Path], out: Path, checkpoint_format: str, device: torch.device, fp8: Fp8Format | None = None
) -> tuple[QuantizeReport, dict[str, str]]:
    """One output file per source file, same name: memory stays bounded by one source shard. `fp8`:
    the source's block-wise FP8 format (its weights dequantized first; a weight whose scale sits
    in a later shard is written with that shard)."""
    before = after = linear_before = linear_after = num_quantized = 0
    weight_map: dict[str, str] = {}
    dequantizer = Fp8Dequantizer(fp8) if fp8 is not None else None
    with tqdm(total=len(tensor_names(files)), desc="quantizing", unit="tensor", disable=None) as bar:
        for f in files:
            written: dict[str, torch.Tensor] = {}
            with safe_open(str(f), framework="pt") as st:
                for read_name in st.keys():
                    read = st.get_tensor(read_name)
                    before += read.nbytes
                    for stored_name, stored in (
                        dequantizer.feed(read_name, read) if dequantizer else ((read_name, read),)
                    ):
                        # Fused MoE experts are written per expert, the layout ModelOpt and
                        # compressed-tensors use, each expert with its own global scales.
                        for name, tensor in (split_fused_experts(stored_name, stored) or {stored_name: stored}).items():
                            parts = _quantized(name, tensor, checkpoint_format, device)
                            if parts is None:
                                parts = {name: tensor}
                            else:
                                linear_before += tensor.nbytes
                                linear_after += sum(t.nbytes for t in parts.values())
                                num_quantized += 1
                            written.update(parts)
                    bar.update(1)
            save_file(written, str(out / f.name), metadata={"format": "pt"})
            after += sum(t.nbytes for t in written.values())
            weight_map.update(dict.fromkeys(written, f.name))
    if dequantizer is not None:
        dequantizer.finish()
    return QuantizeReport(before, after, linear_before, linear_after, num_quantized), weight_map


def _quantized(
    name: str, tensor: torch.Tensor, checkpoint_format: str, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The layout's tensors of a quantizable linear's weight; None for any other tensor."""
    module, _, leaf = name.rpartition(".")
    # ConditionalGeneration checkpoints name the text model model.language_model.*
    if leaf != "weight" or not is_quantizable(canonical_name(module)):
        return None
    nvfp4 = quantize_weight(tensor.to(device), name)
    return {
        f"{module}.{suffix}": t.cpu().contiguous() for suffix, t in weight_to_tensors(checkpoint_format, nvfp4).items()
    }


def _write_configs(
    src: Path,
    out: Path,
    checkpoint_format: str,
    producer_version: str,
    weight_map: dict[str, str],
    total_size: int,
    sharded: bool,
) -> None:
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = checkpoint_quantization_config(checkpoint_format, list(_EXCLUDED))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if checkpoint_format == MODELOPT:
        config = hf_quant_config(list(_EXCLUDED), producer_version)
        (out / HF_QUANT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _copy_other_files(src: Path, out: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _REWRITTEN and not f.name.endswith(_NOT_COPIED_SUFFIXES):
            shutil.copy2(f, out / f.name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="a local float (bf16/fp16/fp32) HF checkpoint folder")
    parser.add_argument("dst", metavar="DST", help="the folder to write; must not exist or be empty")
    parser.add_argument(
        "--format",
        default=MODELOPT,
        choices=CHECKPOINT_FORMATS,
        help="tensor layout: NVIDIA ModelOpt or compressed-tensors nvfp4-pack-quantized (default: modelopt)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to quantize; the result is the same (default: auto, cuda when available)",
    )


def run(args: argparse.Namespace) -> int:
    """The `quantize` subcommand: 0 on success, 2 with one error line for a bad source or flag."""
    from engine.core_types import VERSION
    from engine.model_runner import resolve_device

    try:
        device = resolve_device(args.device)
        report = quantize_checkpoint(
            Path(args.src).expanduser(), Path(args.dst).expanduser(), args.format, device, VERSION
        )
    except ConfigError as e:
        print(f"fp4serve quantize: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    print(f"wrote {args.format} NVFP4 checkpoint to {args.dst}; serve it with: fp4serve serve --model {args.dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4serve quantize", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
