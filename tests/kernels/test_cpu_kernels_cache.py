"""The compiled CPU ops' one-time build (engine/host/cpu_kernels.py): a complete build in the cache is
loaded without compiling again, and a machine whose compiler cannot run serves through the torch
paths and says why."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import engine.host.cpu_kernels as cpu_kernels
from engine.attention.select import choose_backend
from engine.host.cache_folder import build_once, cache_root
from kernels.cpu_ops import LIBRARY_NAME, build_key, compile_library

CPU = torch.device("cpu")


@pytest.fixture()
def unloaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The library as built in the test cache, then a fresh cache root and a process that behaves
    as if the ops were not loaded yet.

    NOTE: torch cannot unload a library; `load_library` of one already loaded returns at once."""
    assert cpu_kernels.load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"
    library = cache_root() / "cpu-kernels" / f"ops-{build_key()}" / LIBRARY_NAME
    monkeypatch.setenv("FP4SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "ops_loaded", lambda: False)
    return library


def test_a_complete_build_in_the_cache_is_loaded_without_compiling(
    unloaded: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    built = cache_root() / "cpu-kernels" / f"ops-{build_key()}"
    build_once(built, lambda folder: shutil.copy(unloaded, folder / LIBRARY_NAME))

    def no_compiler(folder: Path, compiler: str = "g++") -> Path:
        raise AssertionError("compiled again although the cache holds a complete build")

    monkeypatch.setattr(cpu_kernels, "compile_library", no_compiler)
    with caplog.at_level(logging.INFO, logger="fp4serve.cpu_kernels"):
        assert cpu_kernels.load_cpu_ops() is None
    assert f"loaded from {built}" in caplog.text


def test_an_incomplete_build_is_compiled_again(unloaded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library without build_once's marker (a build killed before its rename) is not loaded."""
    built = cache_root() / "cpu-kernels" / f"ops-{build_key()}"
    built.mkdir(parents=True)
    shutil.copy(unloaded, built / LIBRARY_NAME)
    calls: list[Path] = []

    def copy_build(folder: Path, compiler: str = "g++") -> Path:
        calls.append(folder)
        return Path(shutil.copy(unloaded, folder / LIBRARY_NAME))

    monkeypatch.setattr(cpu_kernels, "compile_library", copy_build)
    assert cpu_kernels.load_cpu_ops() is None
    assert len(calls) == 1 and calls[0] != built
    assert cpu_kernels.load_cpu_ops() is None
    assert len(calls) == 1, "the second load found the complete build"


def test_without_a_compiler_the_ops_are_off_with_the_reason(
    unloaded: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing_compiler(folder: Path, compiler: str = "g++") -> Path:
        return compile_library(folder, "/nonexistent/g++")

    monkeypatch.setattr(cpu_kernels, "compile_library", missing_compiler)
    why = cpu_kernels.load_cpu_ops()
    assert why is not None and "/nonexistent/g++ could not run" in why
    folder = cache_root() / "cpu-kernels"
    assert not any(p.name.startswith("ops-") for p in folder.iterdir()), "a failed build left no folder behind"
    with caplog.at_level(logging.INFO, logger="fp4serve.attention"):
        assert choose_backend("auto", CPU, False, dtype=torch.bfloat16, head_dim=64) == "torch"
    assert "torch, since the CPU paged-attention ops could not be built (/nonexistent/g++ could not run" in caplog.text
