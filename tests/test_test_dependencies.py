"""A declared test dependency that is missing stops the run (tests/conftest.py) instead of turning
the tests that need it into skips."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT, missing_test_dependencies


def test_every_declared_test_dependency_is_installed_here() -> None:
    assert missing_test_dependencies(ROOT / "pyproject.toml") == []


def test_a_missing_one_is_named(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\n[project.optional-dependencies]\n'
        'test = ["pytest>=8", "fp4serve-no-such-package>=1.0", "selenium[extra] ; python_version>\'3\'"]\n'
    )
    assert missing_test_dependencies(pyproject) == ["fp4serve-no-such-package"]
