"""Import layering, read from the source with `ast`, with no exceptions: no import circle anywhere in
api/, engine/, scheduler/ or kernels/ (lazy and TYPE_CHECKING imports included); api -> engine ->
{scheduler, kernels}, never back up; nothing imports api; the engine never imports the offline
tooling; the engine core never imports the front (input/output processors, tokenizer, ...);
scheduler/ and api/ import no torch; bench/ is a client of the server over HTTP."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "engine", "scheduler", "kernels", "bench", "fp4serve_tools")
SERVER = {"api", "engine", "scheduler", "kernels"}
GPU_STACK = {"torch", "triton", "flashinfer"}


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name, e.g. "engine.config"
    line: int
    lazy: bool  # inside a function: only runs when that function is called

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def _package_of(path: Path) -> list[str]:
    """Dotted parts of the package a file's relative imports resolve against."""
    return list(path.relative_to(ROOT).parts[:-1])  # the same for a package's __init__.py


def imports_of(path: Path, source: str | None = None) -> list[Import]:
    """Every import in a file: top level, nested in functions or TYPE_CHECKING blocks, relative
    ones resolved, and `importlib.import_module("...")` / `__import__("...")` with a literal name."""
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    package = _package_of(path)
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                    base_name = ".".join(base + ([child.module] if child.module else []))
                    if child.module:
                        found.append(Import(base_name, child.lineno, lazy))
                    else:  # from . import x: each x is a module of the package
                        found.extend(Import(f"{base_name}.{a.name}", child.lineno, lazy) for a in child.names)
                else:
                    found.append(Import(child.module or "", child.lineno, lazy))
            elif isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("import_module", "__import__") and isinstance(child.args[0].value, str):
                    found.append(Import(child.args[0].value, child.lineno, lazy))
            visit(child, inner)

    visit(tree, False)
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations(package: str, rule: Callable[[Path, Import], str | None]) -> list[str]:
    """`rule(path, imp)` returns why an import is not allowed, or None."""
    bad = []
    for path in modules(package):
        for imp in imports_of(path):
            why = rule(path, imp)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}: {why}")
    return bad


def module_name(path: Path) -> str:
    """engine/core.py -> "engine.core"; api/parsers/__init__.py -> "api.parsers"."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (every import: lazy and TYPE_CHECKING ones too).
    An import of a name inside a module (`from engine.core import EngineCore`) is an edge to that
    module; one of a package is an edge to its __init__."""
    names = {module_name(path): path for package in packages for path in modules(package)}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for imp in imports_of(path):
            parts = imp.module.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in names), None)
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every set of modules that import each other in a loop (Tarjan's strongly connected components
    of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


# ---- the parser itself -------------------------------------------------------------------------------
def test_import_parser_sees_relative_nested_and_dynamic_imports() -> None:
    source = (
        "import torch.nn.functional as F\n"
        "from . import protocol, sse\n"
        "from ..engine.config import EngineConfig\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kernels import nvfp4\n"
        "def f():\n    import importlib\n    return importlib.import_module('engine.core')\n"
        "async def g():\n    from scheduler.request import Request\n"
    )
    found = imports_of(ROOT / "api" / "parsers" / "x.py", source)
    assert [(i.module, i.line, i.lazy) for i in found] == [
        ("torch.nn.functional", 1, False),
        ("api.parsers.protocol", 2, False),
        ("api.parsers.sse", 2, False),
        ("api.engine.config", 3, False),
        ("typing", 4, False),
        ("kernels", 6, False),
        ("importlib", 8, True),
        ("engine.core", 9, True),
        ("scheduler.request", 11, True),
    ]


def test_the_circle_finder_sees_loops_of_any_length_and_nothing_else() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_resolves_names_to_their_modules() -> None:
    graph = import_graph(["api", "engine"])
    assert "engine.core_types" in graph["engine.core"]  # from engine.core_types import (...)
    assert "api.parsers" in graph["api.pipeline"]  # a package: its __init__
    assert "engine.weights.demo_model" in graph["engine.weights.model_path"]  # lazy, inside a function


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_modules_to_check(package: str) -> None:
    assert len(modules(package)) >= 2, f"{package}/ has no modules: the layering rules would check nothing"


# ---- the rules -----------------------------------------------------------------------------------------
def test_scheduler_imports_only_itself_and_the_standard_library_no_torch() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        if imp.top in SERVER - {"scheduler"} or imp.top == "bench":
            return "the scheduler sits below the engine and knows nothing above it"
        if imp.top in GPU_STACK:
            return "the scheduler is pure Python"
        return None

    assert violations("scheduler", rule) == []


# The one seam from api/ into the engine: the boundary types, and the errors api/ maps to responses.
API_SEAM = ("engine.front", "engine.front.errors")


def test_api_reaches_the_model_only_through_engine_and_imports_no_torch() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        if imp.top in GPU_STACK:
            return "api/ never touches tensors"
        if imp.top in ("kernels", "bench"):
            return "api/ talks to engine/, not to kernels or the benchmark client"
        if imp.top in ("engine", "scheduler") and imp.module not in API_SEAM:
            return (
                "api/ imports the engine only through its seam, engine.front (the boundary types) and "
                "engine.front.errors (every error it maps to a response)"
            )
        return None

    assert violations("api", rule) == []


def test_the_seam_rule_refuses_a_reach_past_engine_front() -> None:
    source = (
        "from engine.front import EngineConfig\nfrom engine.front.errors import ParamError\n"
        "from engine.config import EngineConfig\nfrom scheduler.request import SamplingParams\n"
        "def f():\n    from engine.front.async_engine import AsyncEngine\n"
    )
    found = imports_of(ROOT / "api" / "x.py", source)
    assert [i.module for i in found if i.top in ("engine", "scheduler") and i.module not in API_SEAM] == [
        "engine.config",
        "scheduler.request",
        "engine.front.async_engine",
    ]


def test_every_name_the_seam_exports_resolves_and_importing_api_loads_no_torch() -> None:
    # Every module of api/ imported, then every name of engine.front's __all__ read (the lazy ones
    # only now): torch may load only with those, never with api/ itself.
    code = (
        "import importlib, pkgutil, sys\n"
        "import api, engine.front, engine.front.errors\n"
        "for m in pkgutil.walk_packages(api.__path__, 'api.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print('torch' in sys.modules)\n"
        "missing = [n for n in engine.front.__all__ + engine.front.errors.__all__\n"
        "           if getattr(engine.front, n, None) is None and getattr(engine.front.errors, n, None) is None]\n"
        "print(missing)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False", "[]"]


def test_no_import_circle_in_the_server() -> None:
    assert circles(import_graph(sorted(SERVER))) == []


def test_engine_never_imports_api_bench_or_the_offline_tooling() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        if imp.top in ("api", "bench"):
            return "the engine sits below the HTTP layer"
        if imp.top == "fp4serve_tools":
            return "fp4serve_tools/ is offline tooling: it may import engine/, never the reverse"
        return None

    assert violations("engine", rule) == []


def test_kernels_import_nothing_of_engine_scheduler_api_or_bench() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        return "kernels/ are leaves below the engine" if imp.top in SERVER - {"kernels"} | {"bench"} else None

    assert violations("kernels", rule) == []


def test_bench_is_an_http_client_except_its_offline_and_kernel_benchmarks() -> None:
    # NOTE: bench/__main__.py's offline subcommand imports engine lazily inside its function, so
    # `bench serve` never loads the server; module-level server imports belong to the module that
    # benchmarks that layer in-process.
    owners = {
        "engine": ("offline.py", "profile.py"),
        "scheduler": ("offline.py", "profile.py"),
        "kernels": ("kernels.py",),
    }

    def rule(path: Path, imp: Import) -> str | None:
        if imp.top == "api":
            return "bench/ drives the server over HTTP, never through api/"
        if imp.top in owners and path.name not in owners[imp.top] and not imp.lazy:
            return f"only bench/{' or '.join(owners[imp.top])} may import {imp.top}/ at module level"
        return None

    assert violations("bench", rule) == []


# The engine's front: what runs in the HTTP process around the core (text, validation, admission,
# metrics, the per-request streams). Every other engine module is the core's, or below it.
FRONT = {
    "engine.front.async_engine",
    "engine.front.admission",
    "engine.front.input_processor",
    "engine.front.output_processor",
    "engine.front.outputs",
    "engine.front.tokenizer",
    "engine.front.detokenizer",
    "engine.front.metrics",
    "engine.front.offline",
    "engine.client.core_client",
    "engine.client.supervisor",
    "engine.front.vllm_metrics",
    "engine.client.placement",
    "engine.client.core_router",
    "engine.client.global_fair_share",
}
# The modules of the core's step (its own process): token ids only, no tokenizer.
CORE_STEP = (
    "core.py",
    "core_proc.py",
    "core_types.py",
    "model_runner.py",
    "sampler.py",
    "batch.py",
    "cuda_graph.py",
    "prompt_logprobs.py",
)
CORE_STEP_PACKAGES = ("spec_decode", "attention", "models")


def test_the_engine_core_never_imports_the_front() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        if module_name(path) in FRONT or module_name(path) in API_SEAM:
            return None
        # api/'s seam (engine/front/__init__.py, errors.py) re-exports the front: the core imports neither
        target = next((m for m in FRONT if imp.module == m or imp.module.startswith(m + ".")), None)
        target = target or (imp.module if imp.module in API_SEAM else None)
        return f"the core knows nothing of the front ({target})" if target else None

    assert violations("engine", rule) == []


def test_the_core_step_imports_no_tokenizer() -> None:
    def rule(path: Path, imp: Import) -> str | None:
        in_step = path.parent.name == "engine" and path.name in CORE_STEP or path.parent.name in CORE_STEP_PACKAGES
        if in_step and imp.top in ("tokenizers", "fp4serve_tools"):
            return "the engine core speaks token ids; text lives in the front"
        return None

    assert violations("engine", rule) == []


@pytest.mark.parametrize("package", ["engine", "scheduler", "kernels", "bench", "fp4serve_tools"])
def test_nothing_outside_api_imports_api(package: str) -> None:
    def rule(path: Path, imp: Import) -> str | None:
        return "nothing imports api/" if imp.top == "api" else None

    assert violations(package, rule) == []


# ---- the same rules, as the interpreter sees them ---------------------------------------------------------
@pytest.mark.parametrize(
    ("modules_to_import", "must_not_load"),
    [
        (["scheduler.scheduler", "scheduler.block_manager", "scheduler.output"], ["torch", "engine", "api"]),
        (["bench.serve", "bench.stats", "bench.report", "bench.__main__"], ["engine", "scheduler", "api", "torch"]),
    ],
)
def test_importing_a_layer_does_not_load_what_lies_above_or_the_gpu_stack(
    modules_to_import: list[str], must_not_load: list[str]
) -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {modules_to_import!r}: importlib.import_module(m)\n"
        f"print(sorted(p for p in {must_not_load!r} if p in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
