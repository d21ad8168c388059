"""`Compiler`: xgrammar's GrammarCompiler for one tokenizer, and what building it needs (the
checkpoint's tokenizer, xgrammar's `TokenizerInfo`), started at start-up on a thread of its own; and
`GrammarFailed`, a grammar that could not be built or compiled, with its reason.

NOTE: loading the tokenizer and building `TokenizerInfo` run in Python under the GIL (seconds for a
150k vocabulary, docs/PERF.md): built on the first constrained request, they would stall every
stream in flight for that long. `start` runs them while the model loads instead; a compile that
comes before they are done waits for them, never builds them a second time. The tables of a
checkpoint folder's tokenizer are also kept on disk, under the cache root's grammar-tables/, keyed
by the hash of its tokenizer files: every later engine start (a restart, another server on the
same model) reads them back instead of loading the tokenizer and building them again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.host.cache_folder import cache_root
from scheduler.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger("fp4serve.structured")


class GrammarFailed(RuntimeError):
    """A request's grammar could not be made. `reason`: "tokenizer" (the compiler's tables could
    not be built), "build" (our EBNF for the spec: engine/grammars/) or "compile" (xgrammar refused
    the grammar); it labels fp4serve_grammar_failures_total."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class Compiler:
    """Thread-safe: `compile` runs on GrammarCache's pool threads, `start` on the engine's."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a transformers tokenizer, or the checkpoint folder to load one from;
        `vocab_size`: the model's (padded) logits width."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()  # one build, whoever asks first
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._error: GrammarFailed | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build the compiler's tables now, on a thread (the start-up's, while the model loads)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._quietly_built, name="fp4serve-grammar-tables", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for `start`'s build; whether it is over (built or failed)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return self._compiler is not None or self._error is not None

    def compile(self, spec: StructuredOutput) -> Any:
        """`spec` compiled (xgrammar.CompiledGrammar); GrammarFailed with its reason otherwise.
        Which compiler each kind uses: engine/structured_output/manager.py."""
        compiler = self._built()
        if spec.kind == "regex":
            try:
                return compiler.compile_regex(spec.text)
            except Exception as e:
                raise GrammarFailed("compile", _last_line(e)) from e
        from engine.grammars import ebnf

        try:
            text = ebnf(spec)
        except Exception as e:
            raise GrammarFailed("build", f"{type(e).__name__}: {_last_line(e)}") from e
        try:
            return compiler.compile_grammar(text)
        except Exception as e:
            raise GrammarFailed("compile", _last_line(e)) from e

    def _quietly_built(self) -> None:
        try:
            self._built()
        except GrammarFailed:
            pass  # logged by _built; each constrained request fails with it

    def _built(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._compiler is None:
                try:
                    self._compiler = self._build()
                except Exception as e:
                    logger.exception("the grammar compiler could not be built: constrained requests will fail")
                    self._error = GrammarFailed("tokenizer", f"{type(e).__name__}: {_last_line(e)}")
                    raise self._error from e
            return self._compiler

    def _build(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        started = time.perf_counter()
        tokenizer = self._tokenizer
        if isinstance(tokenizer, (str, Path)):
            info = _tokenizer_info(str(Path(tokenizer).resolve()), self._vocab_size)
        else:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size)
        logger.info(
            "grammar compiler: tokenizer tables of %d tokens ready in %.2f s",
            self._vocab_size,
            time.perf_counter() - started,
        )
        # One thread per compile: the machine's cores belong to the model. xgrammar's own cache is
        # off (it would be a second, unmetered copy): GrammarCache keeps compiled grammars.
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


# NOTE: one process may build several engines on one checkpoint (tests, benchmarks, a restart in
# process): the tables are a pure function of the tokenizer files, so they are built once per
# process and shared read-only, never seconds of GIL-bound work again per engine.
@functools.lru_cache(maxsize=4)
def _tokenizer_info(folder: str, vocab_size: int) -> xgrammar.TokenizerInfo:
    import xgrammar

    path = tables_path(Path(folder), vocab_size)
    try:
        return xgrammar.TokenizerInfo.deserialize_json(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError, RuntimeError) as e:  # damaged: built again below, and rewritten
        logger.warning(
            "grammar tables %s unreadable (%s: %s); building them again", path, type(e).__name__, _last_line(e)
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    _write_tables(path, info.serialize_json())
    return info


# What AutoTokenizer reads from a checkpoint folder: the tables are a function of these files.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "config.json",
)
TABLES_FORMAT = 1  # bump when what is stored changes


def tables_path(folder: Path, vocab_size: int) -> Path:
    """Where the tables of `folder`'s tokenizer at `vocab_size` are kept: named by the hash of its
    tokenizer files and of the xgrammar and transformers versions that build them."""
    digest = hashlib.sha256(f"{TABLES_FORMAT} {vocab_size}".encode())
    for package in ("xgrammar", "transformers"):
        digest.update(f" {package} {importlib.metadata.version(package)}".encode())
    for name in TOKENIZER_FILES:
        file = folder / name
        if file.is_file():
            digest.update(f" {name} ".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return cache_root() / "grammar-tables" / f"{digest.hexdigest()[:32]}.json"


def _write_tables(path: Path, text: str) -> None:
    """Written to a file of its own and renamed into place: a reader sees all of it or none. A
    cache that cannot be written only costs the next start the build."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(text)
        staging.chmod(0o644)  # a shared FP4SERVE_CACHE stays readable by every user
        os.replace(staging, path)
    except OSError as e:
        logger.warning("grammar tables not kept in %s: %s", path.parent, e)
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)


def _last_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1][:300] if lines else type(error).__name__
