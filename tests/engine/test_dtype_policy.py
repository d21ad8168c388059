"""`--dtype auto`: what each checkpoint dtype runs as, on a CPU with and without native bf16
(the flag probe is replaced, so these run the same on any CPU), on CUDA, and under int8/int4;
`--quantization auto`: int4 for the built-in SmolLM2 on an AVX512 CPU (int8 without AVX512), with dense
copies from a row count
that follows the CPU's bf16 support; and `--kv-cache-dtype`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import engine.weights.dtype_policy as policy
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.weights.dtype_policy import resolve_dtype, resolve_quantization
from engine.weights.model_source import DEFAULT_MODEL_ENV, DEFAULT_MODEL_NAME, DEMO_MODEL_KEYWORD

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-bf16"])
def native_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(policy, "cpu_has_native_bf16", lambda: request.param)
    return request.param


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_always_wins(native_bf16: bool, checkpoint: str, name: str) -> None:
    for device in (CPU, CUDA):
        for quantization in (None, "int8", "nvfp4"):
            assert resolve_dtype(name, checkpoint, device, quantization) == getattr(torch, name)


def test_auto_on_a_cpu_with_native_bf16_runs_float_checkpoints_as_bf16(native_bf16: bool) -> None:
    expected = BF16 if native_bf16 else F32
    assert resolve_dtype("auto", "float32", CPU) == expected
    assert resolve_dtype("auto", "bfloat16", CPU) == expected
    assert resolve_dtype("auto", "float16", CPU) == expected  # CPUs are slow at fp16 (docs/PERF.md)
    assert resolve_dtype("auto", "float32", CPU, "nvfp4") == expected


def test_auto_under_int8_or_int4_takes_bf16_activations_on_any_cpu(native_bf16: bool) -> None:
    for checkpoint in ("float32", "bfloat16", "float16"):
        assert resolve_dtype("auto", checkpoint, CPU, "int8") == BF16
        assert resolve_dtype("auto", checkpoint, CPU, "int4") == BF16


def test_auto_on_cuda_ignores_the_cpu_flags(native_bf16: bool) -> None:
    assert resolve_dtype("auto", "float32", CUDA) == BF16
    assert resolve_dtype("auto", "bfloat16", CUDA) == BF16
    assert resolve_dtype("auto", "float16", CUDA) == F16


def test_the_engine_applies_the_policy(qwen3_ckpt: Path, native_bf16: bool) -> None:
    """qwen3_ckpt is a float32 checkpoint."""
    runner = OfflineEngine.from_config(EngineConfig(model=str(qwen3_ckpt), kv_cache_memory="2MiB")).core.runner
    assert runner.dtype == (BF16 if native_bf16 else F32)
    assert runner.model.embed_tokens.weight.dtype == runner.dtype and runner.kv_caches[0].dtype == runner.dtype


def test_the_probe_reads_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(policy, "CPUINFO", cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert not policy.cpu_has_native_bf16()
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert policy.cpu_has_native_bf16()
    cpuinfo.write_text("flags\t\t: fpu amx_tile amx_bf16\n")
    assert policy.cpu_has_native_bf16()
    cpuinfo.unlink()
    assert not policy.cpu_has_native_bf16()


def test_quantization_auto_makes_the_builtin_smollm2_int4_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV)  # what users get without --model
    monkeypatch.setattr(policy, "int4_kernel_is_fast", lambda: True)
    assert resolve_quantization("auto", None, CPU) == "int4"
    assert resolve_quantization("auto", DEFAULT_MODEL_NAME, CPU) == "int4"
    assert resolve_quantization("auto", None, CUDA) is None
    assert resolve_quantization("auto", "/models/SmolLM2-135M-Instruct", CPU) is None  # a folder: as it is
    assert resolve_quantization("auto", DEMO_MODEL_KEYWORD, CPU) is None
    assert resolve_quantization("none", None, CPU) is None and resolve_quantization(None, None, CPU) is None
    assert resolve_quantization("nvfp4", None, CPU) == "nvfp4"
    assert resolve_quantization("auto", None, CPU, "bfloat16") == "int4"
    assert resolve_quantization("auto", None, CPU, "float32") is None  # int4/int8 run bf16 activations
    assert resolve_quantization("int8", None, CPU, "float32") == "int8"  # asked for: done (with a warning)
    assert resolve_quantization("int4", None, CPU) == "int4"
    monkeypatch.setenv(DEFAULT_MODEL_ENV, DEMO_MODEL_KEYWORD)  # the suite's default: the demo stays bf16
    assert resolve_quantization("auto", None, CPU) is None


def test_quantization_auto_takes_int8_where_the_int4_kernel_has_no_avx512(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.INFO, logger="fp4serve.runner"):
        assert resolve_quantization("auto", None, CPU) == "int8"
    assert "runs int8 on this CPU (torch's int4 kernel has no fast path without AVX512, here AVX2)" in caplog.text
    assert resolve_quantization("int4", None, CPU) == "int4"  # asked for: done
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve_quantization("auto", None, CPU) == "int4"


def test_an_unknown_quantization_fails_in_the_config() -> None:
    with pytest.raises(ConfigError, match="--quantization: 'int2' is not one of auto, none, nvfp4, int8, int4"):
        EngineConfig(quantization="int2")


def test_auto_keeps_dense_copies_from_a_row_count_that_follows_the_cpus_bf16(native_bf16: bool) -> None:
    """int4 dense copies: packed bf16 from 8 rows where bf16 is native, float32 from 16 rows elsewhere;
    int8 keeps its 16; an explicit scheme keeps no copy (its memory saving)."""
    assert policy.int8_dense_from_rows("auto", "int4") == (policy.AUTO_INT4_DENSE_FROM_ROWS if native_bf16 else 16)
    assert policy.int8_dense_from_rows("auto", "int8") == 16
    assert policy.int8_dense_from_rows("int4", "int4") == 0 and policy.int8_dense_from_rows("int8", "int8") == 0
    assert policy.int8_dense_from_rows("auto", None) == 0


def test_kv_cache_dtype_auto_follows_the_model_and_others_are_cpu_only() -> None:
    assert policy.resolve_kv_cache_dtype("auto", F32, CPU) == F32
    assert policy.resolve_kv_cache_dtype("auto", BF16, CUDA) == BF16
    assert policy.resolve_kv_cache_dtype("bfloat16", F32, CPU) == BF16
    assert policy.resolve_kv_cache_dtype("float32", BF16, CPU) == F32
    assert policy.resolve_kv_cache_dtype("bfloat16", BF16, CUDA) == BF16  # the model's own: fine anywhere
    with pytest.raises(ConfigError, match="--kv-cache-dtype float32: on cuda the KV cache holds the model dtype"):
        policy.resolve_kv_cache_dtype("float32", BF16, CUDA)
    with pytest.raises(ConfigError, match="--kv-cache-dtype: 'fp8' is not one of auto, bfloat16, float16, float32"):
        EngineConfig(kv_cache_dtype="fp8")
