"""scripts/regroup.py, the mechanical regroup of engine/ and api/: its mapping fits the folder limit on
this tree, and its rewrite changes module references only (imports, strings, comments, paths),
never an attribute that merely shares a module's name; a scratch repository is regrouped end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regroup", ROOT / "scripts" / "regroup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regroup"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


regroup = _load()
RENAMES = regroup.Renames.of(regroup.MOVES)


def test_the_mapping_moves_each_module_once_into_a_package_that_says_what_it_owns() -> None:
    targets = list(regroup.MOVES.values())
    assert len(targets) == len(set(targets))
    assert not set(targets) & set(regroup.MOVES), "a module moved onto another one's old place"
    existing = {"engine", "api", "engine/attention", "engine/models", "engine/spec_decode", "api/parsers"}
    for target in targets:
        assert target.rsplit("/", 1)[0] in set(regroup.NEW_PACKAGES) | existing, target
    assert not set(regroup.MOVES) & set(regroup.STAY), "a module both moves and stays"


def test_this_tree_regroups_within_the_folder_limit() -> None:
    plan = regroup.plan(ROOT)
    assert plan.clashes == []
    assert plan.over() == [], plan.counts
    assert plan.counts["engine"][1] <= regroup.MAX_TOP and plan.counts["api"][1] <= regroup.MAX_TOP


def test_code_keeps_attributes_that_share_a_module_name_while_imports_strings_and_paths_move() -> None:
    source = '''"""Reads engine/quantization.py's formats and api.parse_output."""
from engine import cpu_threads, gguf as g, config
from engine import quantization
from engine.admission import (
    QueueLimits,
    preparing,
)
import engine.loader
import engine.packed_linear as packed


def f(engine, monkeypatch):
    monkeypatch.setattr(engine.loader, "keeps_fp8", None)  # the module: imported plainly above
    monkeypatch.setattr("engine.structured.StructuredOutputs", None)
    text = engine.tokenizer.decode([1])  # see engine/tokenizer.py
    return f"{engine.output_processor.x} engine.metrics", ["-m", "api.cli"], text
'''
    out = regroup.rewrite_python(source, RENAMES)
    assert out == '''"""Reads engine/weights/formats/nvfp4.py's formats and api.parsers.parse_output."""
from engine.host import cpu_threads
from engine.weights.formats import gguf as g
from engine import config
from engine.weights.formats import nvfp4 as quantization
from engine.front.admission import (
    QueueLimits,
    preparing,
)
import engine.weights.loader
import engine.weights.formats.packed_linear as packed


def f(engine, monkeypatch):
    monkeypatch.setattr(engine.weights.loader, "keeps_fp8", None)  # the module: imported plainly above
    monkeypatch.setattr("engine.structured_output.manager.StructuredOutputs", None)
    text = engine.tokenizer.decode([1])  # see engine/front/tokenizer.py
    return f"{engine.output_processor.x} engine.front.metrics", ["-m", "api.cli"], text
'''


def test_an_old_module_named_like_a_new_package_is_renamed_but_not_the_package() -> None:
    # api/responses.py (chat's shared pieces) becomes api/openai/shared.py; api/responses/ is the Responses API.
    text = "api.responses and api.responses.UsageCounter; api.responses_store; api/responses.py"
    assert regroup.rewrite_text(text, RENAMES) == (
        "api.openai.shared and api.openai.shared.UsageCounter; api.responses.store; api/openai/shared.py")
    assert regroup.rewrite_text("api.responses.store and api.responses.request", RENAMES) == (
        "api.responses.store and api.responses.request")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    files = {
        "engine/__init__.py": "",
        "engine/quantization.py": "LINEAR_SUFFIXES = ('weight',)\n",
        "engine/loader.py": "from engine.quantization import LINEAR_SUFFIXES\n\nSUFFIXES = LINEAR_SUFFIXES\n",
        "engine/new_module.py": '"""A module a later branch adds, which the mapping does not know."""\n',
        "api/__init__.py": "",
        "api/responses.py": "ID = 'chatcmpl'\n",
        "api/responses_store.py": "from api.responses import ID\n\nSTORE = {ID: 1}\n",
        "README.md": "The loader (engine/loader.py) and the store (`api.responses_store`).\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "before")
    return tmp_path


def test_a_scratch_repository_regroups_and_imports(scratch: Path) -> None:
    plan = regroup.plan(scratch)
    assert plan.unmapped == ["engine/new_module.py"]
    assert "engine/structured.py" in plan.missing
    regroup.apply(plan, scratch)
    status = _git(scratch, "status", "--short")
    assert "R  engine/quantization.py -> engine/weights/formats/nvfp4.py" in status
    assert "R  api/responses.py -> api/openai/shared.py" in status
    assert (scratch / "api/responses/store.py").read_text().startswith("from api.openai.shared import ID")
    assert "engine/weights/loader.py" in (scratch / "README.md").read_text()
    assert "`api.responses.store`" in (scratch / "README.md").read_text()
    assert (scratch / "engine/weights/formats/__init__.py").read_text().startswith('"""Weight formats')
    code = "import engine.weights.loader, api.responses.store; print(engine.weights.loader.SUFFIXES, api.responses.store.STORE)"
    done = subprocess.run([sys.executable, "-c", code], cwd=scratch, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "('weight',) {'chatcmpl': 1}", done.stderr
    again = regroup.plan(scratch)
    assert again.moves == {} and "engine/loader.py" in again.done


def test_a_branch_merged_after_the_regroup_gets_its_old_names_rewritten(scratch: Path) -> None:
    regroup.apply(regroup.plan(scratch), scratch)
    late = "from engine.quantization import LINEAR_SUFFIXES\nfrom api.responses import ID\n"
    (scratch / "engine/late.py").write_text(late)
    _git(scratch, "add", "engine/late.py")
    regroup.rewrite_late(regroup.plan(scratch), scratch)
    # api.responses names the Responses API's package now: left for a person, and listed.
    assert (scratch / "engine/late.py").read_text() == (
        "from engine.weights.formats.nvfp4 import LINEAR_SUFFIXES\nfrom api.responses import ID\n")
