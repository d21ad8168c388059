"""Shared fixtures: tiny checkpoints (built once per session) and engine helpers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Before torch is imported anywhere (see engine/__init__.py for why).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

# Keep test runs from writing into the user's cache; the demo model is built once per machine here.
os.environ.setdefault("FP4SERVE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "test"))
# Tests (and the servers they spawn) run the tiny random Qwen3 when no --model is given, not SmolLM2.
os.environ.setdefault("FP4SERVE_DEFAULT_MODEL", "fp4serve-demo-qwen3")

from tests.durations import FILE_SECONDS  # noqa: E402
from tests.factories import make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Every dependency the `test` extra declares must be installed: a missing one is an error
    here, not a silent skip of the tests that need it (triton's interpreted kernels, selenium's
    browser tests). CUDA-only tests still skip without a GPU."""
    missing = missing_test_dependencies(ROOT / "pyproject.toml")
    if missing:
        raise pytest.UsageError(
            f"declared test dependencies are not installed: {', '.join(missing)}; run `pip install -e '.[test]'`"
        )
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        # The controller of `pytest -n N` (make test): the CPU ops compile here, once, before the
        # workers start; otherwise the first worker to need them compiles while the others wait on
        # its lock (engine/host/cache_folder.py), on a fresh machine for a minute or more.
        from engine.host.cpu_kernels import load_cpu_ops

        load_cpu_ops()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest files first (tests/durations.py), each file's tests in their own order: `make test`
    hands whole files to two workers in this order (--no-loadscope-reorder), so the long files
    start early and the short ones fill in at the end instead of one worker finishing alone."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0.0))


# Folders whose files share a session-scoped server (tests/agents/conftest.py): under `make test` each
# goes to one worker as a whole, so the server starts once rather than once per worker.
SHARED_SERVER_FOLDERS = ("tests/agents/",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile, except that each of SHARED_SERVER_FOLDERS is one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((folder for folder in SHARED_SERVER_FOLDERS if path.startswith(folder)), path)

    return SharedServerScheduling(config, log)


def missing_test_dependencies(pyproject: Path) -> list[str]:
    """The distributions the `test` extra of `pyproject` names that are not installed."""
    import importlib.metadata
    import re
    import tomllib

    declared = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["test"]
    missing = []
    for requirement in declared:
        name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("llama"),
        "llama",
        tie=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
