"""The mechanical regroup of engine/ and api/ into folders of one concern each (issue 25 item 4):
`git mv` per module, then every reference rewritten (imports, dotted names in strings such as
`python -m api.cli` or mock targets, file paths in comments and docs). No code changes otherwise.

Re-runnable after merges: a module already at its new place is left alone, a module of the tree
that the mapping does not name stays where it is and is listed, and the plan is refused (nothing
moved) when a folder would hold more than MAX_TOP Python files at its top level.

    python scripts/regroup.py --check   # print the plan and the folder counts; change nothing
    python scripts/regroup.py           # git mv, write the new packages' __init__.py, rewrite
    python scripts/regroup.py --rewrite # later: a branch merged after the regroup still names old modules
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_TOP = 15
PACKAGES = ("engine", "api")

# What each new folder owns: its __init__.py's docstring.
NEW_PACKAGES: dict[str, str] = {
    "engine/front": "The engine's front, in the server's process: AsyncEngine, the input and output processors, the\n"
                    "tokenizer and detokenizer, admission, the metrics and the offline driver. Text lives here;\n"
                    "the core below speaks token ids.",
    "engine/client": "How the front reaches its engine core(s): in this process or a spawned one, the supervisor that\n"
                     "keeps it, and with data parallel the router, placement and global fair share over N cores.",
    "engine/host": "What the engine takes of the machine it runs on: the heartbeat in shared memory, the C\n"
                   "allocator, CPU threads, the compiled CPU ops and the on-disk cache folder.",
    "engine/cache_events": "What the engine tells the outside of its KV cache: vLLM's KV-cache events with their block\n"
                           "hashes, and the prefix-cache feed that data parallel places requests by.",
    "engine/structured_output": "Grammar-constrained decoding: the compiled grammars (by bytes, compiled off the step thread)\n"
                                "and the per-request matchers and token bitmasks.",
    "engine/weights": "Where weights come from and how they reach the model: what --model names (folders, GGUF, the\n"
                      "demo), checkpoint files and tensor names, the loader and its plan, the dtype policy.",
    "engine/weights/formats": "Weight formats, one file each: NVFP4, int8, int4, packed bf16, FP8 linears and their builders,\n"
                              "and GGUF files as HF folders.",
    "api/request": "The typed request every protocol maps into: OpenAI's chat and completions models, the chat\n"
                   "messages and tools, and the validation base every protocol's models share.",
    "api/openai": "OpenAI's chat and completions responses (the pipeline's encoders and the pieces they share), and\n"
                  "vLLM's /tokenize and /detokenize.",
    "api/responses": "OpenAI's Responses API: its request model and mapping, its output events, its routes, the\n"
                     "response store and its tools.",
    "api/anthropic": "Anthropic's Messages API: its request model and mapping, and its routes and event encoder.",
    "api/grammars": "Grammars from the request: tool_choice and JSON schemas as xgrammar EBNF, response_format.",
    "api/access": "Who may call and how much: API keys and credentials, request limits, rate limits, and the\n"
                  "request log of refusals.",
    "api/transport": "The HTTP mechanics below every route: body framing, the client watch, requests in flight and\n"
                     "their deadlines, SSE, the HTTP-side metrics and hypercorn's HTTP/2 mends.",
    "api/ops": "What operators read: the web page, /stats, the per-key metrics and /openapi.json.",
    "api/flags": "Groups of `fp4serve serve` flags with their own settings objects, so api/cli.py only calls in.",
}

# Old path -> new path. A module of a branch not merged yet is here too: missing is reported, not fatal.
MOVES: dict[str, str] = {
    # engine/front/: the server-process half, text in and out
    "engine/async_engine.py": "engine/front/async_engine.py",
    "engine/admission.py": "engine/front/admission.py",
    "engine/input_processor.py": "engine/front/input_processor.py",
    "engine/output_processor.py": "engine/front/output_processor.py",
    "engine/outputs.py": "engine/front/outputs.py",
    "engine/tokenizer.py": "engine/front/tokenizer.py",
    "engine/detokenizer.py": "engine/front/detokenizer.py",
    "engine/offline.py": "engine/front/offline.py",
    "engine/metrics.py": "engine/front/metrics.py",
    "engine/vllm_metrics.py": "engine/front/vllm_metrics.py",
    "engine/chat_messages.py": "engine/front/chat_messages.py",  # agentfront
    "engine/prompt_bound.py": "engine/front/prompt_bound.py",  # agentfront
    # engine/client/: reaching, keeping and routing between engine cores
    "engine/core_client.py": "engine/client/core_client.py",
    "engine/supervisor.py": "engine/client/supervisor.py",
    "engine/core_router.py": "engine/client/core_router.py",  # dataparallel
    "engine/placement.py": "engine/client/placement.py",  # dataparallel
    "engine/global_fair_share.py": "engine/client/global_fair_share.py",  # dataparallel
    # engine/host/: the machine and the process
    "engine/heartbeat.py": "engine/host/heartbeat.py",
    "engine/allocator.py": "engine/host/allocator.py",
    "engine/cpu_threads.py": "engine/host/cpu_threads.py",
    "engine/cpu_kernels.py": "engine/host/cpu_kernels.py",  # cpuspeed
    "engine/cache_folder.py": "engine/host/cache_folder.py",
    # engine/cache_events/
    "engine/kv_events.py": "engine/cache_events/kv_events.py",
    "engine/kv_event_hashes.py": "engine/cache_events/kv_event_hashes.py",
    "engine/prefix_cache_feed.py": "engine/cache_events/prefix_cache_feed.py",  # dataparallel
    # engine/structured_output/
    "engine/structured.py": "engine/structured_output/manager.py",
    "engine/grammar_cache.py": "engine/structured_output/grammar_cache.py",
    # engine/attention/: paged attention and the DeltaNet backends, their reference, the state pools
    "engine/linear_attention.py": "engine/attention/linear_attention.py",
    "engine/linear_attention_fla.py": "engine/attention/linear_attention_fla.py",
    "engine/models/gated_delta.py": "engine/attention/gated_delta.py",
    "engine/hybrid_backend.py": "engine/attention/hybrid_backend.py",
    "engine/hybrid_runner.py": "engine/attention/hybrid_runner.py",
    "engine/state_pool.py": "engine/attention/state_pool.py",
    "engine/checkpoint_pool.py": "engine/attention/checkpoint_pool.py",
    # engine/weights/
    "engine/loader.py": "engine/weights/loader.py",
    "engine/checkpoint_files.py": "engine/weights/checkpoint_files.py",
    "engine/linear_plan.py": "engine/weights/linear_plan.py",
    "engine/moe_loader.py": "engine/weights/moe_loader.py",
    "engine/mtp_source.py": "engine/weights/mtp_source.py",
    "engine/models/qwen3_5_weights.py": "engine/weights/qwen3_5_names.py",
    "engine/dtype_policy.py": "engine/weights/dtype_policy.py",
    "engine/generation_config.py": "engine/weights/generation_config.py",  # agentfront
    "engine/model_source.py": "engine/weights/model_source.py",
    "engine/model_path.py": "engine/weights/model_path.py",
    "engine/demo_model.py": "engine/weights/demo_model.py",
    "engine/qwen_tokenizer.py": "engine/weights/qwen_tokenizer.py",
    # engine/weights/formats/
    "engine/quantization.py": "engine/weights/formats/nvfp4.py",
    "engine/int8_linear.py": "engine/weights/formats/int8_linear.py",
    "engine/int4_linear.py": "engine/weights/formats/int4_linear.py",  # cpuspeed
    "engine/packed_linear.py": "engine/weights/formats/packed_linear.py",  # cpuspeed
    "engine/fp8.py": "engine/weights/formats/fp8.py",
    "engine/shard_checks.py": "engine/weights/formats/shard_checks.py",
    "engine/gguf.py": "engine/weights/formats/gguf.py",
    "engine/gguf_arch.py": "engine/weights/formats/gguf_arch.py",
    # api/request/: the typed request below the pipeline
    "api/models.py": "api/request/models.py",
    "api/messages.py": "api/request/messages.py",
    "api/validation.py": "api/request/validation.py",
    # api/openai/
    "api/chat.py": "api/openai/chat.py",
    "api/completions.py": "api/openai/completions.py",
    "api/responses.py": "api/openai/shared.py",
    "api/tokenize.py": "api/openai/tokenize.py",
    "api/openai_stream.py": "api/openai/stream.py",
    # api/responses/: the Responses API
    "api/responses_request.py": "api/responses/request.py",
    "api/responses_output.py": "api/responses/output.py",
    "api/responses_routes.py": "api/responses/routes.py",
    "api/responses_store.py": "api/responses/store.py",
    "api/responses_tools.py": "api/responses/tools.py",  # agentfront
    # api/anthropic/ (its error shape stays beside api/errors.py, which renders it for every route)
    "api/anthropic_request.py": "api/anthropic/request.py",
    "api/anthropic_routes.py": "api/anthropic/routes.py",
    # api/grammars/
    "api/tool_grammar.py": "api/grammars/tool_grammar.py",
    "api/response_format.py": "api/grammars/response_format.py",
    # api/access/
    "api/keys.py": "api/access/keys.py",
    "api/auth.py": "api/access/auth.py",
    "api/limits.py": "api/access/limits.py",
    "api/rate_limit.py": "api/access/rate_limit.py",
    "api/request_log.py": "api/access/request_log.py",  # agentfront
    # api/transport/
    "api/framing.py": "api/transport/framing.py",
    "api/client_watch.py": "api/transport/client_watch.py",
    "api/inflight.py": "api/transport/inflight.py",
    "api/deadline.py": "api/transport/deadline.py",
    "api/sse.py": "api/transport/sse.py",
    "api/hypercorn_h2.py": "api/transport/hypercorn_h2.py",
    "api/metrics.py": "api/transport/metrics.py",
    # api/ops/
    "api/ui.py": "api/ops/ui.py",
    "api/stats.py": "api/ops/stats.py",
    "api/key_metrics.py": "api/ops/key_metrics.py",
    "api/openapi.py": "api/ops/openapi.py",
    # api/flags/
    "api/team_args.py": "api/flags/team.py",
    "api/reliability_args.py": "api/flags/reliability.py",
    "api/agent_args.py": "api/flags/agent.py",  # agentfront
    # api/parsers/
    "api/parse_output.py": "api/parsers/parse_output.py",
}

# Modules that stay where they are, on purpose (anything else that is not moved is listed).
STAY: tuple[str, ...] = (
    "engine/__init__.py", "engine/config.py", "engine/errors.py",
    "engine/core_types.py", "engine/core.py", "engine/core_proc.py", "engine/model_runner.py", "engine/batch.py",
    "engine/sampler.py", "engine/cuda_graph.py", "engine/prompt_logprobs.py",
    "engine/attention/*", "engine/models/*", "engine/spec_decode/*",
    "api/__init__.py", "api/__main__.py", "api/cli.py", "api/app.py", "api/server.py", "api/state.py", "api/http.py",
    "api/routes.py", "api/pipeline.py", "api/engine_stream.py", "api/errors.py", "api/anthropic_errors.py",
    "api/context_errors.py", "api/parsers/*",
)
# Text files whose references are rewritten (by suffix or name); these three are skipped: they spell the old names.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ".sh", ".jinja"}
TEXT_NAMES = {"Makefile", "run"}
SKIP = {"scripts/regroup.py", "scripts/regroup_architecture.md", "tests/test_regroup.py"}


def module_of(path: str) -> str:
    """engine/weights/loader.py -> engine.weights.loader."""
    return path[: -len(".py")].replace("/", ".")


@dataclass(frozen=True)
class Plan:
    moves: dict[str, str]  # old path -> new path, to do now
    done: list[str]  # old paths already at their new place
    missing: list[str]  # mapped, but neither old nor new path exists
    clashes: list[str]  # both old and new path exist
    unmapped: list[str]  # modules of engine/ and api/ that the mapping neither moves nor keeps
    new_packages: list[str]  # folders whose __init__.py is to be written
    counts: dict[str, tuple[int, int]]  # folder -> Python files at its top level, before and after

    def over(self) -> list[str]:
        return [folder for folder, (_, after) in self.counts.items() if after > MAX_TOP]


def _tracked(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if (root / line).is_file()]


def _stays(path: str) -> bool:
    return any(path == rule or rule.endswith("/*") and path.startswith(rule[:-1]) and "/" not in path[len(rule) - 1:]
               for rule in STAY)


def _top_counts(files: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in files:
        if not path.endswith(".py") or path.split("/")[0] not in PACKAGES:
            continue
        folder = path.rsplit("/", 1)[0]
        counts[folder] = counts.get(folder, 0) + 1
    return counts


def plan(root: Path = ROOT) -> Plan:
    files = set(_tracked(root))
    moves, done, missing, clashes = {}, [], [], []
    for old, new in MOVES.items():
        if old in files and new in files:
            clashes.append(old)
        elif old in files:
            moves[old] = new
        elif new in files:
            done.append(old)
        else:
            missing.append(old)
    after = (files - set(moves)) | set(moves.values())
    new_packages = [folder for folder in NEW_PACKAGES
                    if f"{folder}/__init__.py" not in files and any(p.startswith(folder + "/") for p in after)]
    after |= {f"{folder}/__init__.py" for folder in new_packages}
    targets = set(MOVES.values())
    unmapped = sorted(p for p in files if p.endswith(".py") and p.split("/")[0] in PACKAGES
                      and p not in MOVES and p not in targets and not _stays(p)
                      and not any(p == f"{folder}/__init__.py" for folder in NEW_PACKAGES))
    before_counts, after_counts = _top_counts(files), _top_counts(after)
    counts = {folder: (before_counts.get(folder, 0), after_counts.get(folder, 0))
              for folder in sorted(set(before_counts) | set(after_counts))}
    return Plan(moves, done, missing, clashes, unmapped, new_packages, counts)


# ---- rewriting ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Renames:
    modules: dict[str, str]  # old dotted name -> new
    paths: dict[str, str]  # old file path -> new

    @staticmethod
    def of(moves: dict[str, str]) -> Renames:
        return Renames({module_of(old): module_of(new) for old, new in moves.items()}, dict(moves))

    @functools.cached_property
    def dotted_re(self) -> re.Pattern[str] | None:
        if not self.modules:
            return None
        new_names = set(self.modules.values())
        parts = []
        for old in sorted(self.modules, key=len, reverse=True):
            # NOTE: an old module's name can be a new package's (api.responses): its new children are not it.
            children = sorted({n[len(old) + 1:].split(".")[0] for n in new_names if n.startswith(old + ".")})
            guard = f"(?!\\.(?:{'|'.join(map(re.escape, children))})\\b)" if children else ""
            parts.append(re.escape(old) + guard)
        return re.compile(r"(?<![\w.])(" + "|".join(parts) + r")(?![\w])")

    @functools.cached_property
    def path_re(self) -> re.Pattern[str] | None:
        if not self.paths:
            return None
        names = "|".join(re.escape(old) for old in sorted(self.paths, key=len, reverse=True))
        return re.compile(r"(?<![\w/.-])(" + names + r")(?![\w])")


def rewrite_text(text: str, renames: Renames) -> str:
    """Dotted module names (imports, `python -m`, mock targets, prose) and file paths, old to new."""
    dotted = renames.dotted_re
    if dotted is not None:
        text = dotted.sub(lambda m: renames.modules[m.group(1)], text)
    paths = renames.path_re
    if paths is not None:
        text = paths.sub(lambda m: renames.paths[m.group(1)], text)
    return text


def _rewrite_token(text: str, renames: Renames) -> str:
    """A string or comment token; an f-string's {fields} are code and stay as written."""
    prefix = re.match(r"[A-Za-z]*", text).group(0)
    if "f" not in prefix.lower():
        return rewrite_text(text, renames)
    pieces = re.split(r"(\{[^{}]*\})", text)
    return "".join(piece if i % 2 else rewrite_text(piece, renames) for i, piece in enumerate(pieces))


def rewrite_strings_and_comments(source: str, renames: Renames) -> str:
    """Python: dotted names and paths only inside strings and comments, never in code, where
    `engine.tokenizer` is as often an AsyncEngine's attribute as the module."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    for tok in reversed(tokens):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        new = _rewrite_token(tok.string, renames)
        if new == tok.string:
            continue
        (srow, scol), (erow, ecol) = tok.start, tok.end
        head, tail = lines[srow - 1][:scol], lines[erow - 1][ecol:]
        lines[srow - 1:erow] = [head + new + tail]
    return "".join(lines)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _renamed_module(name: str, renames: Renames) -> str | None:
    """engine.loader -> engine.weights.loader; also a name below a moved module."""
    for old, new in renames.modules.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


def _segment(lines: list[str], start: int, col: int, end: int, end_col: int) -> str:
    """The source of a node, from ast's positions (columns count UTF-8 bytes)."""
    raw = [line.encode("utf-8") for line in lines[start - 1:end]]
    if len(raw) == 1:
        return raw[0][col:end_col].decode("utf-8")
    return (raw[0][col:] + b"".join(raw[1:-1]) + raw[-1][:end_col]).decode("utf-8")


def rewrite_imports(source: str, renames: Renames) -> str:
    """Python code: `import engine.x[ as y]`, `from engine.x import ...`, `from engine import x, gguf as g`
    (one statement per new package, the local names kept: `import nvfp4 as quantization` where the
    file was renamed), and `engine.x.attr` in a file that did a plain `import engine.x`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    plain = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for a in node.names if a.asname is None and _renamed_module(a.name, renames)}
    dotted = renames.dotted_re
    segments = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []
    for node in ast.walk(tree):
        span = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset) if isinstance(node, ast.stmt) else None
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and any(
                f"{_renamed_module(node.module, renames) or node.module}.{a.name}" in renames.modules for a in node.names):
            module = _renamed_module(node.module, renames) or node.module
            groups: dict[str, list[str]] = {}
            for alias in node.names:
                new = renames.modules.get(f"{module}.{alias.name}")
                package, leaf = new.rsplit(".", 1) if new else (module, alias.name)
                local = alias.asname or alias.name
                groups.setdefault(package, []).append(leaf if local == leaf else f"{leaf} as {local}")
            indent = " " * node.col_offset
            edits.append((*span, f"\n{indent}".join(f"from {package} import {', '.join(names)}"
                                                     for package, names in groups.items())))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and dotted is not None:
            # Only module names stand in an import statement: rename them where they are written, so a
            # parenthesised list keeps its lines.
            text = _segment(segments, *span)
            new_text = dotted.sub(lambda m: renames.modules[m.group(1)], text)
            if new_text != text:
                edits.append((*span, new_text))
        elif isinstance(node, ast.Attribute) and plain and node.lineno == node.end_lineno:
            name = _dotted(node)
            if name in renames.modules and any(p == name or p.startswith(name + ".") for p in plain):
                edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, renames.modules[name]))
    lines = [line.encode("utf-8") for line in source.splitlines(keepends=True)]
    for start, col, end, end_col, text in sorted(edits, reverse=True):  # ast offsets count UTF-8 bytes
        head, tail = lines[start - 1][:col], lines[end - 1][end_col:]
        lines[start - 1:end] = [head + text.encode("utf-8") + tail]
    return b"".join(lines).decode("utf-8")


def rewrite_python(source: str, renames: Renames) -> str:
    return rewrite_imports(rewrite_strings_and_comments(source, renames), renames)


def rewrite_file(path: Path, renames: Renames) -> bool:
    try:
        original = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return False
    text = rewrite_python(original, renames) if path.suffix == ".py" else rewrite_text(original, renames)
    if text == original:
        return False
    path.write_text(text, encoding="utf-8")
    return True


def is_text(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path not in SKIP and (Path(name).suffix in TEXT_SUFFIXES or name in TEXT_NAMES)


def leftovers(root: Path, renames: Renames) -> list[str]:
    """Mentions the rewrite could not place: bare file names of renamed modules (`quantization.py`),
    and a moved module's file name as a string (a path built from parts)."""
    renamed = {old.rsplit("/", 1)[1]: new for old, new in renames.paths.items()
               if old.rsplit("/", 1)[1] != new.rsplit("/", 1)[1]}
    moved_names = {old.rsplit("/", 1)[1] for old in renames.paths} - {"__init__.py"}
    bare = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, renamed)) + r")(?![\w])") if renamed else None
    found = []
    for rel in _tracked(root):
        if not is_text(rel):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if bare is not None and (m := bare.search(line)):
                found.append(f"{rel}:{number}: bare {m.group(1)} (now {renamed[m.group(1)]})")
            if rel.endswith(".py") and any(f'"{n}"' in line or f"'{n}'" in line for n in moved_names):
                found.append(f"{rel}:{number}: a moved module's file name as a string: {line.strip()}")
    return found


# ---- applying -----------------------------------------------------------------------------------------------
def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True)


def apply(p: Plan, root: Path = ROOT) -> list[str]:
    """The moves (through temporary names first: api/responses.py makes way for api/responses/), the new
    packages' __init__.py, then every reference. Returns the files rewritten."""
    for old in p.moves:
        _git(root, "mv", old, old + ".regroup-tmp")
    for old, new in p.moves.items():
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        _git(root, "mv", old + ".regroup-tmp", new)
    for folder in p.new_packages:
        init = root / folder / "__init__.py"
        init.write_text(f'"""{NEW_PACKAGES[folder]}"""\n', encoding="utf-8")
        _git(root, "add", str(init.relative_to(root)))
    renames = Renames.of(p.moves)
    sorted_before = _imports_sorted(root, [rel for rel in _tracked(root) if rel.endswith(".py")])
    changed = [rel for rel in _tracked(root) if is_text(rel) and rewrite_file(root / rel, renames)]
    _sort_imports(root, [rel for rel in changed if rel in sorted_before])
    _git(root, "add", "-u")
    return changed


def _ruff() -> str | None:
    beside = Path(sys.executable).parent / "ruff"
    return str(beside) if beside.exists() else shutil.which("ruff")


RUFF_ISORT = ("check", "--select", "I", "--line-length", "120", "--no-cache", "--quiet")


def _imports_sorted(root: Path, files: list[str]) -> set[str]:
    """The files whose imports ruff's isort finds in order now (empty without ruff): only their order
    is mended after the rewrite, so a file sorted otherwise on purpose keeps its order."""
    ruff = _ruff()
    if ruff is None or not files:
        return set()
    done = subprocess.run([ruff, *RUFF_ISORT, "--output-format", "json", *files], cwd=root, capture_output=True,
                          text=True)
    unsorted = {str(Path(item["filename"]).resolve().relative_to(root.resolve())) for item in json.loads(done.stdout or "[]")}
    return set(files) - unsorted


def _sort_imports(root: Path, files: list[str]) -> None:
    ruff = _ruff()
    if ruff is None:
        print("ruff not found: the rewritten imports keep their places (not re-sorted)")
    elif files:
        subprocess.run([ruff, *RUFF_ISORT, "--fix", *files], cwd=root, check=False)


def report(p: Plan) -> None:
    for old, new in p.moves.items():
        print(f"git mv {old} {new}")
    for folder in p.new_packages:
        print(f"new package {folder}/__init__.py")
    for old in p.done:
        print(f"already moved: {old} -> {MOVES[old]}")
    for old in p.missing:
        print(f"mapped but missing (a branch not merged yet?): {old}")
    for old in p.clashes:
        print(f"CLASH: both {old} and {MOVES[old]} exist; left alone")
    for path in p.unmapped:
        print(f"not in the mapping, stays where it is: {path}")
    print("Python files at each folder's top level (before -> after):")
    for folder, (before, after) in p.counts.items():
        print(f"  {folder + '/':32} {before:3} -> {after:3}{'   OVER ' + str(MAX_TOP) if after > MAX_TOP else ''}")


def rewrite_late(p: Plan, root: Path = ROOT) -> int:
    """References to modules moved earlier. An old name that is now a package's (api.responses, the
    old chat pieces, now the Responses API's folder) cannot be told apart: it is listed, not rewritten."""
    packages = {folder.replace("/", ".") for folder in NEW_PACKAGES}
    moved = {old: MOVES[old] for old in p.done if module_of(old) not in packages}
    for old in sorted(set(p.done) - set(moved)):
        print(f"check by hand: {module_of(old)} (now {module_of(MOVES[old])}) is also a package's name now")
    renames = Renames.of(moved)
    changed = [rel for rel in _tracked(root) if is_text(rel) and rewrite_file(root / rel, renames)]
    print(f"rewrote {len(changed)} files: {' '.join(changed)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print the plan and the folder counts; change nothing")
    parser.add_argument("--rewrite", action="store_true",
                        help="after a branch merged past the regroup: rewrite its references to modules already moved")
    args = parser.parse_args(argv)
    p = plan()
    report(p)
    if args.rewrite:
        return rewrite_late(p)
    if p.over() or p.clashes:
        print(f"refused: {', '.join(p.over()) or 'clashes'} (over {MAX_TOP} files, or a clash); nothing moved",
              file=sys.stderr)
        return 1
    if args.check:
        return 0
    changed = apply(p)
    print(f"moved {len(p.moves)} modules, wrote {len(p.new_packages)} __init__.py, rewrote {len(changed)} files")
    for line in leftovers(ROOT, Renames.of({**p.moves, **{old: MOVES[old] for old in p.done}})):
        print(f"check by hand: {line}")
    final = plan()
    print("Python files at each folder's top level now:")
    for folder, (_, now) in final.counts.items():
        print(f"  {folder + '/':32} {now:3}{'   OVER ' + str(MAX_TOP) if now > MAX_TOP else ''}")
    return 1 if final.over() else 0


if __name__ == "__main__":
    sys.exit(main())
