"""Group tests/ into subfolders that mirror the packages (tests/api/, tests/engine/, tests/scheduler/,
tests/kernels/, tests/bench/, tests/tools/), mechanically: one `git mv` per test file, then only the
fixes the move needs (imports of moved test modules, `Path(__file__)` one level deeper, mentions of
the old paths in docs). Shared helpers (conftest.py, factories, server_utils, ...) and the
repository-wide tests (layering, test dependencies) stay at the top; tests/gpu/ stays as it is.

Re-runnable after merges: a file already in its folder is left alone, and a test file that no rule
places stays at the top and is listed, so a new file only needs its rule added here.

    python scripts/group_tests.py           # print the plan
    python scripts/group_tests.py --apply   # git mv and rewrite; then run the suite
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
STAY = {
    "__init__.py",
    "conftest.py",
    "factories.py",
    "server_utils.py",
    "browser.py",
    "gguf_factory.py",
    "mtp_factory.py",
    "fp8_factory.py",
    "graph_fakes.py",
    "h2_client.py",
    "vllm_kv_events.py",
    "test_layering.py",
    "test_test_dependencies.py",
    "test_repo_hygiene.py",
    "test_folder_sizes.py",
    "durations.py",
}
# folder -> file-name patterns, first match wins: a model feature's server test (test_hybrid_server)
# belongs with the feature, so engine/ comes before api/'s catch-alls.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("scheduler", ("test_scheduler*.py", "test_block_manager*.py", "test_fair_queue*.py", "test_slot_manager*.py")),
    (
        "kernels",
        (
            "test_nvfp4.py",
            "test_nvfp4_matmul*.py",
            "test_nvfp4_scale_search*.py",
            "test_fused_moe*.py",
            "test_kernel*.py",
            "test_cpu_*.py",
        ),
    ),
    ("bench", ("test_bench_*.py", "test_soak*.py", "test_lm_eval*.py")),
    ("tools", ("test_bundle*.py", "test_quantize*.py", "test_cli_commands*.py")),
    (
        "engine",
        (
            "test_engine_*.py",
            "test_input_processor*.py",
            "test_output_processor*.py",
            "test_detokenizer*.py",
            "test_sampler*.py",
            "test_loader*.py",
            "test_gguf*.py",
            "test_hybrid_*.py",
            "test_moe_*.py",
            "test_spec_*.py",
            "test_prompt_logprobs*.py",
            "test_structured*.py",
            "test_demo_model*.py",
            "test_default_model*.py",
            "test_dtype_policy*.py",
            "test_int8_*.py",
            "test_linear_attention*.py",
            "test_gated_delta*.py",
            "test_short_rows*.py",
            "test_serial_cpu_ops*.py",
            "test_fast_decode*.py",
            "test_opaque_attention*.py",
            "test_attention_*.py",
            "test_cuda_graph*.py",
            "test_flashinfer_*.py",
            "test_nvfp4_engine*.py",
            "test_admission*.py",
            "test_fp8_engine*.py",
        ),
    ),
    (
        "api",
        (
            "test_api_*.py",
            "test_agent_*.py",
            "test_vllm_*.py",
            "test_shutdown*.py",
            "test_messages_*.py",
            "test_responses_*.py",
            "test_tools_e2e*.py",
            "test_completions_*.py",
            "test_tokenize_*.py",
            "test_keys*.py",
            "test_parsers_*.py",
            "test_response_format*.py",
            "test_tool_grammar*.py",
            "test_ui_*.py",
            "test_team_*.py",
            "test_robustness_*.py",
            "test_*_server.py",
            "test_pipeline*.py",
        ),
    ),
]
# Where the old paths are written down outside tests/.
DOCS = ("README.md", "docs", "Makefile", ".ci", "pyproject.toml")


# The fallback for a file no pattern names: the package it tests, read from its imports, the one it
# imports most (a test that parses flags through api.cli but builds an engine is an engine test); one
# that starts a real server is an API test.
IMPORTS = re.compile(r"^\s*(?:from|import)\s+(api|engine|scheduler|kernels|bench|fp4serve_tools)\b", re.MULTILINE)
SERVER = re.compile(r"\b(start_server|running_server|start_in_process|in_process_server)\b")
FOLDER_OF = {
    "api": "api",
    "engine": "engine",
    "scheduler": "scheduler",
    "kernels": "kernels",
    "bench": "bench",
    "fp4serve_tools": "tools",
}


def folder_by_imports(path: Path) -> str | None:
    text = path.read_text()
    counts = {package: 0 for package in FOLDER_OF}
    for package in IMPORTS.findall(text):
        counts[package] += 1
    if SERVER.search(text):
        counts["api"] += 100
    best = max(counts, key=lambda package: (counts[package], -list(FOLDER_OF).index(package)))
    return FOLDER_OF[best] if counts[best] else None


def folder_for(name: str, path: Path | None = None) -> str | None:
    for folder, patterns in RULES:
        if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            return folder
    return folder_by_imports(path) if path is not None else None


def plan() -> tuple[dict[str, str], list[str]]:
    """(module name -> folder) for the top-level test files to move, and those no rule places."""
    moves, unplaced = {}, []
    for path in sorted(TESTS.glob("*.py")):
        if path.name in STAY:
            continue
        folder = folder_for(path.name, path)
        if folder is None:
            unplaced.append(path.name)
        else:
            moves[path.stem] = folder
    return moves, unplaced


def rewrite(path: Path, moves: dict[str, str], moved_here: bool) -> None:
    try:
        text = original = path.read_text()
    except UnicodeDecodeError:  # an image or other binary file beside the docs
        return
    # `from tests.test_x import ...`, `import tests.test_x`
    text = re.sub(
        r"\btests\.(test_\w+)\b",
        lambda m: f"tests.{moves[m.group(1)]}.{m.group(1)}" if m.group(1) in moves else m.group(0),
        text,
    )
    # `tests/test_x.py` written in strings and comments
    text = re.sub(
        r"\btests/(test_\w+)\.py",
        lambda m: f"tests/{moves[m.group(1)]}/{m.group(1)}.py" if m.group(1) in moves else m.group(0),
        text,
    )
    if moved_here:  # one folder deeper: the repository root is one more parent up
        text = text.replace("Path(__file__).resolve().parent.parent", "Path(__file__).resolve().parents[2]")
        text = text.replace("Path(__file__).resolve().parents[1]", "Path(__file__).resolve().parents[2]")
    if text != original:
        path.write_text(text)


def apply(moves: dict[str, str]) -> None:
    for folder in sorted(set(moves.values())):
        init = TESTS / folder / "__init__.py"
        if not init.exists():
            init.parent.mkdir(exist_ok=True)
            init.write_text("")
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for module, folder in moves.items():
        subprocess.run(["git", "mv", f"tests/{module}.py", f"tests/{folder}/{module}.py"], cwd=ROOT, check=True)
    moved = {TESTS / folder / f"{module}.py" for module, folder in moves.items()}
    for path in TESTS.rglob("*.py"):
        rewrite(path, moves, path in moved)
    for entry in DOCS:
        target = ROOT / entry
        files = (
            [target]
            if target.is_file()
            else sorted(p for p in target.rglob("*") if p.is_file())
            if target.exists()
            else []
        )
        for path in files:
            rewrite(path, moves, moved_here=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apply", action="store_true", help="git mv the files and rewrite the imports and paths")
    args = parser.parse_args(argv)
    moves, unplaced = plan()
    for module, folder in moves.items():
        print(f"tests/{module}.py -> tests/{folder}/{module}.py")
    for name in unplaced:
        print(f"tests/{name}: no rule places it; it stays (add a pattern to RULES)", file=sys.stderr)
    if args.apply:
        apply(moves)
        print(f"moved {len(moves)} files; now run the suite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
