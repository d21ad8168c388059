"""Which attention backend the engine runs (engine/attention/select.py), checked without a GPU:
torch whenever asked for, FlashInfer on CUDA when it imports and covers the model, a fallback to
torch that says why, one-line ConfigErrors, and an import probe that never imports flashinfer on CPU."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from engine.attention.select import choose_backend, flashinfer_import_error, make_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.errors import ConfigError
from engine.weights.config.model_config import ModelConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BS = 4  # tokens per KV page in these tests


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("available", [True, False])
def test_torch_is_used_whenever_asked_for(device: torch.device, available: bool) -> None:
    assert choose_backend("torch", device, available) == "torch"


def test_auto_picks_flashinfer_on_cuda_when_it_imports_and_covers_the_model() -> None:
    assert choose_backend("auto", CUDA, True, dtype=torch.bfloat16, head_dim=128) == "flashinfer"
    assert choose_backend("flashinfer", CUDA, True, dtype=torch.float16, head_dim=64) == "flashinfer"


@pytest.mark.parametrize(
    ("device", "available", "dtype", "head_dim", "reason"),
    [
        # On a CPU, auto takes the compiled paged-attention ops (tests/kernels/test_cpu_attention.py) unless
        # they do not cover the dtypes, as float16 activations over a bf16 cache.
        (CPU, True, torch.float16, 16, "paged-attention ops do not cover float16 activations with a bfloat16 KV cache"),
        (CUDA, False, torch.bfloat16, 128, "flashinfer does not import here"),
        (CUDA, True, torch.float32, 128, "does not cover dtype float32"),
        (CUDA, True, torch.bfloat16, 80, "does not cover head_dim 80"),
    ],
)
def test_auto_falls_back_to_torch_and_logs_why(
    device: torch.device,
    available: bool,
    dtype: torch.dtype,
    head_dim: int,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="fp4serve.attention"):
        kv_dtype = torch.bfloat16 if device.type == "cpu" else None
        assert choose_backend("auto", device, available, dtype=dtype, head_dim=head_dim, kv_dtype=kv_dtype) == "torch"
    [record] = caplog.records
    assert reason in record.getMessage()
    assert record.levelno == (logging.WARNING if device.type == "cuda" else logging.INFO)


@pytest.mark.parametrize(
    ("device", "available", "dtype", "head_dim", "reason"),
    [
        (CPU, True, None, None, "needs a CUDA device, this run uses cpu"),
        (CUDA, False, None, None, "flashinfer does not import here"),
        (CUDA, True, torch.float32, 128, "does not cover dtype float32"),
    ],
)
def test_flashinfer_where_it_cannot_run_is_a_one_line_config_error(
    device: torch.device, available: bool, dtype: torch.dtype | None, head_dim: int | None, reason: str
) -> None:
    with pytest.raises(ConfigError) as e:
        choose_backend("flashinfer", device, available, dtype=dtype, head_dim=head_dim)
    message = str(e.value)
    assert message.startswith("--attention-backend flashinfer: ") and reason in message and "\n" not in message


def test_an_unknown_backend_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'flash' is not one of auto, flashinfer, cpu, torch"):
        choose_backend("flash", CUDA, True)


class _ImportRecorder:
    """A meta-path finder that records top-level imports and lets the next finder resolve them."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        self.names.append(name)


def test_the_import_probe_never_imports_flashinfer_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert flashinfer_import_error(CPU) == "the device is cpu, not CUDA"
    assert "flashinfer" not in recorder.names
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # as if it is not installed
    assert flashinfer_import_error(CUDA).startswith("import flashinfer failed (ModuleNotFoundError")


def test_make_backend_builds_the_torch_reference(qwen3_ckpt: Path) -> None:
    cfg = ModelConfig.from_checkpoint(qwen3_ckpt)
    backend = make_backend("torch", cfg, torch.float32, CPU, BS)
    assert isinstance(backend, TorchAttentionBackend) and backend.num_kv_heads == cfg.num_kv_heads
