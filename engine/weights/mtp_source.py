"""The MTP head from a second checkpoint folder (`--speculative-model`, FlashRT's setup: an NVFP4
export drops `mtp.*`, the FP8 or bf16 release of the same model still has it). Only its `mtp.*`
tensors are read; block-wise FP8 ones are dequantized to float (the head is one layer, so the
body's quantization does not extend to it). Its config must describe the same model: the fields the
head's shapes and the shared embedding / lm_head depend on are checked, with one line naming the
first that differs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ConfigError
from engine.models.qwen3_5_mtp import MTP_PREFIX
from engine.weights.checkpoint_files import checkpoint_files, tensor_names
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.fp8 import SCALE_SUFFIX, Fp8Dequantizer, fp8_format

# Fields of the two configs that must agree: the head's layer shapes, its norms, and the
# embedding and lm_head it shares with the body.
_SAME = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps")
_FIELD_NAMES = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


@dataclass(frozen=True)
class MtpSource:
    path: Path
    files: tuple[Path, ...]
    names: tuple[str, ...]  # the mtp.* tensors as the loader places them (no FP8 scale tensors)
    fp8: bool  # dequantized from block-wise FP8

    @staticmethod
    def open(path: Path, body: ModelConfig) -> MtpSource:
        """Check the folder's config against the body's and list its mtp.* tensors."""
        flag = f"--speculative-model {path}"
        if not path.is_dir():
            raise ConfigError(f"{flag}: not a local checkpoint folder")
        try:
            cfg = ModelConfig.from_checkpoint(path)
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None
        if cfg.model_type != body.model_type:
            raise ConfigError(
                f"{flag}: a {cfg.architecture} checkpoint; the model is {body.architecture} "
                "(the MTP head must come from the same model)"
            )
        for field in _SAME:
            mine, theirs = getattr(body, field), getattr(cfg, field)
            if mine != theirs:
                raise ConfigError(
                    f"{flag}: {_FIELD_NAMES.get(field, field)} is {theirs} in its config.json, "
                    f"{mine} in the model's (the MTP head must come from the same model)"
                )
        try:
            fmt = fp8_format(cfg.quantization)
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None
        if cfg.quantization is not None and fmt is None:
            raise ConfigError(
                f"{flag}: its MTP head is quantized as {cfg.quantization.get('quant_method')!r}; "
                "supported: bf16/fp16/fp32 or block-wise fp8"
            )
        files = checkpoint_files(path)
        names = [n for n in tensor_names(files) if n.startswith(MTP_PREFIX)]
        if not names:
            raise ConfigError(f"{flag}: has no mtp.* tensors (no MTP head to take)")
        placed = tuple(n for n in names if not n.endswith(SCALE_SUFFIX))
        return MtpSource(path, tuple(files), placed, fmt is not None)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The mtp.* tensors, FP8 ones dequantized to float32, read one at a time."""
        cfg = ModelConfig.from_checkpoint(self.path)
        fmt = fp8_format(cfg.quantization)
        dequantizer = Fp8Dequantizer(fmt) if fmt is not None else None
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if not name.startswith(MTP_PREFIX):
                        continue
                    tensor = st.get_tensor(name)
                    if dequantizer is None:
                        yield name, tensor
                    else:
                        yield from dequantizer.feed(name, tensor)
        if dequantizer is not None:
            try:
                dequantizer.finish()
            except ConfigError as e:
                raise ConfigError(f"--speculative-model {self.path}: {e}") from None

    @property
    def num_tensors(self) -> int:
        return len(self.names)
