"""Every folder stays small enough to read at a glance: the serving packages (api/, engine/,
scheduler/ and their subpackages) hold at most 15 Python modules each at their top level, so a new
noun goes into the subpackage that owns it; kernels/, bench/ and each tests/ folder have looser
bounds. A folder that grows past its bound is split by owner, not given a higher number."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("api", "engine", "scheduler")
SERVING_LIMIT = 15
# Flat by design: a kernel sits beside its reference; a bench module is one command; tests mirror
# the packages one folder deep.
LOOSER = {"kernels": 25, "bench": 50, "fp4serve_tools": 15, "scripts": 15}
TESTS_LIMIT = 80


def modules(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py"))


def packages(top: str) -> list[Path]:
    return sorted(p.parent for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("top", SERVING)
def test_each_serving_package_holds_at_most_15_modules(top: str) -> None:
    over = {str(p.relative_to(ROOT)): len(modules(p)) for p in packages(top) if len(modules(p)) > SERVING_LIMIT}
    assert over == {}, f"split these by owner: {over}"


@pytest.mark.parametrize(("top", "limit"), sorted(LOOSER.items()))
def test_flat_folders_stay_within_their_bound(top: str, limit: int) -> None:
    assert len(modules(ROOT / top)) <= limit, modules(ROOT / top)


def test_each_tests_folder_stays_within_its_bound() -> None:
    folders = [ROOT / "tests", *(p for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__")]
    over = {p.name: len(modules(p)) for p in folders if len(modules(p)) > TESTS_LIMIT}
    assert over == {}, f"split these by the package they test: {over}"
