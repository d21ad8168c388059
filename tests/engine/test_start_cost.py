"""What a server's start pays for: the engine process loads a model without torch's compiler
stack (torch._dynamo, sympy); a spawned engine process, which imports the server's main module
`api.cli` again, does not import the HTTP app with it; and the server's process imports xgrammar
while the engine loads, not before it starts it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from api.state import load_engine
from engine.config import EngineConfig
from engine.front.async_engine import AsyncEngine
from engine.structured_output.manager import StructuredOutputs
from tests.factories import make_hybrid_checkpoint
from tests.server_utils import REPO

COMPILER_STACK = ("torch._dynamo", "sympy")


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.splitlines()[-1].split())


def load_and_step(model: Path) -> str:
    return (
        "from engine.config import EngineConfig\n"
        "from engine.front.offline import OfflineEngine\n"
        "from scheduler.request import SamplingParams\n"
        f"engine = OfflineEngine.from_config(EngineConfig(model={str(model)!r}, dtype='float32', kv_cache_memory='8MiB'))\n"  # noqa: E501
        "engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))\n"
    )


def test_loading_and_running_a_model_imports_no_compiler_stack(qwen3_ckpt: Path) -> None:
    loaded = modules_after(load_and_step(qwen3_ckpt))
    assert "engine.core" in loaded
    assert not loaded & set(COMPILER_STACK), sorted(loaded & set(COMPILER_STACK))


def test_loading_a_hybrid_model_imports_no_compiler_stack(tmp_path: Path) -> None:
    loaded = modules_after(load_and_step(make_hybrid_checkpoint(tmp_path / "hybrid")))
    assert not loaded & set(COMPILER_STACK), sorted(loaded & set(COMPILER_STACK))


def test_the_main_module_a_spawned_engine_imports_again_is_light() -> None:
    loaded = modules_after("import api.cli")
    assert not {"api.app", "api.flags.serve", "engine.front", "asyncio", "torch"} & loaded
    # ... and still gives what its importers take from it
    assert "api.flags.serve" in modules_after("from api.cli import server_config, build_parser")


class FakeClient:
    def __init__(self) -> None:
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


class FakeEngine:
    def __init__(self) -> None:
        self.clients = [FakeClient()]


def test_the_engine_starts_while_the_grammar_library_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    started = threading.Event()
    engine = FakeEngine()

    def from_config(config: EngineConfig) -> Any:
        started.set()
        return engine

    def prepare_checks() -> None:  # xgrammar's import, which takes seconds
        assert started.wait(20), "the engine was started only after xgrammar's import"

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr(StructuredOutputs, "prepare_checks", staticmethod(prepare_checks))
    assert load_engine(EngineConfig(model="unused")) is engine


def test_a_failed_grammar_import_fails_the_load_and_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()

    def prepare_checks() -> None:
        raise ImportError("no xgrammar")

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(lambda config: engine))
    monkeypatch.setattr(StructuredOutputs, "prepare_checks", staticmethod(prepare_checks))
    with pytest.raises(ImportError, match="no xgrammar"):
        load_engine(EngineConfig(model="unused"))
    assert engine.clients[0].stopped
