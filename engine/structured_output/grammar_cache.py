"""`GrammarCache`: compiled grammars by their spec (a frozen `StructuredOutput`: equal specs share
one grammar), bounded by bytes, and the compiles that fill it.

- Each kept grammar is charged xgrammar's own size of it (`memory_size_bytes`); the least recently
  used leave once the total passes the budget, and a grammar larger than the whole budget is served
  but not kept. A request holds its grammar from arrival to end: one that left the cache meanwhile
  stays in memory until its last request ends, and is counted apart (`held_bytes`), so that the two
  numbers add up to all the compiled grammars the engine holds.
- Compiles run on a small pool of threads (xgrammar releases the GIL while it compiles). Each key
  compiles one grammar at a time and keys take turns, so a key that sends many large schemas delays
  only its own requests: another key's schema waits at most for the compiles already running.
- A compile that no request holds any more (all were aborted before it started) is dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.config import DEFAULT_GRAMMAR_CACHE_BYTES
from engine.core_types import GrammarCacheStats

logger = logging.getLogger("fp4serve.structured")

DEFAULT_COMPILE_WORKERS = 2  # a small pool: the cores belong to the model


@dataclass(eq=False)
class _Entry:
    future: Future[Any]
    key: str  # the API key whose request asked first: whose turn the compile takes
    holders: int = 0  # requests holding the grammar (waiting for it or running with it)
    started: bool = False
    size: int = 0  # xgrammar's size, once compiled
    kept: bool = False  # in the cache, charged to the budget


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim, else nothing. NOTE: glibc keeps a freed grammar's pages in its arenas
    (one per compile thread) instead of returning them: without it the resident size would stay at
    its peak after an eviction. It takes ~10 ms after a large grammar, so it runs on a thread."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return lambda: None
    return lambda: threading.Thread(target=trim, args=(0,), name="fp4serve-malloc-trim", daemon=True).start()


class GrammarCache:
    """Thread-safe: `get` and `release` run on the engine's thread, compiles on the pool's."""

    def __init__(
        self,
        compile_fn: Callable[[Any], Any],
        budget_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        num_workers: int = DEFAULT_COMPILE_WORKERS,
    ) -> None:
        assert budget_bytes >= 0 and num_workers >= 1, f"budget {budget_bytes}, workers {num_workers}"
        self.budget_bytes = budget_bytes
        self._compile_fn = compile_fn
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # spec -> entry, least recent first
        self._held: dict[Future[Any], _Entry] = {}  # every entry some request holds, in the cache or not
        self._queues: dict[str, deque[Hashable]] = {}  # key -> specs waiting to start, in arrival order
        self._turns: deque[str] = deque()  # keys with grammars waiting, next turn first
        self._compiling: set[str] = set()  # keys with a compile running
        self._executor: ThreadPoolExecutor | None = None
        self._trim = _malloc_trim()
        self._bytes = 0  # kept
        self._held_bytes = 0  # held by requests, not kept
        self._hits = self._misses = self._evictions = 0

    def get(self, grammar: Hashable, key: str, hold: bool = True) -> Future[Any]:
        """The grammar compiled, compiling, or queued for `key`'s next turn. With `hold`, the caller
        holds it until it calls `release` with the returned future."""
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is not None:
                self._entries.move_to_end(grammar)
                self._hits += 1
            else:
                self._misses += 1
                entry = self._entries[grammar] = _Entry(Future(), key)
                self._queues.setdefault(key, deque()).append(grammar)
                if key not in self._turns:
                    self._turns.append(key)
                self._dispatch()
            if hold:
                entry.holders += 1
                self._held[entry.future] = entry
            return entry.future

    def release(self, future: Future[Any]) -> None:
        """A holder of `future` is done with it (its request ended, or was aborted before it ran)."""
        freed = False
        with self._lock:
            entry = self._held.get(future)
            if entry is None:
                return
            entry.holders -= 1
            if entry.holders > 0:
                return
            del self._held[future]
            if not entry.started:  # nobody wants it: never compiled
                self._forget_queued(entry)
                future.cancel()
            elif entry.future.done() and not entry.kept:
                self._held_bytes -= entry.size
                freed = entry.size > 0
        if freed:
            self._trim()

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(
                num_bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                num_entries=sum(1 for e in self._entries.values() if e.kept),
                held_bytes=self._held_bytes,
                num_compiling=len(self._compiling),
                num_queued=sum(len(q) for q in self._queues.values()),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    # ---- internals (the lock held where it says so) ---------------------------------------------
    def _forget_queued(self, entry: _Entry) -> None:
        """With the lock held: drop an entry whose compile has not started."""
        grammar = next(text for text, e in self._entries.items() if e is entry)
        del self._entries[grammar]
        queue = self._queues.get(entry.key)
        if queue is not None and grammar in queue:
            queue.remove(grammar)
            if not queue:
                del self._queues[entry.key]
                self._turns.remove(entry.key)

    def _dispatch(self) -> None:
        """With the lock held: start compiles while workers are free, one key at a time in turn."""
        while len(self._compiling) < self._num_workers:
            key = next((k for k in self._turns if k not in self._compiling), None)
            if key is None:
                return
            self._turns.remove(key)
            queue = self._queues[key]
            grammar = queue.popleft()
            if queue:
                self._turns.append(key)  # its next grammar waits for the other keys' turns
            else:
                del self._queues[key]
            entry = self._entries[grammar]
            entry.started = True
            self._compiling.add(key)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._num_workers, thread_name_prefix="fp4serve-grammar")
            self._executor.submit(self._run, grammar, key, entry)

    def _run(self, grammar: Hashable, key: str, entry: _Entry) -> None:
        """On a pool thread: compile, charge, evict, then start the next compile."""
        compiled: Any = None
        error: BaseException | None = None
        try:
            compiled = self._compile_fn(grammar)
        except BaseException as e:  # noqa: BLE001 - handed to the holders through the future
            error = e
        with self._lock:
            self._compiling.discard(key)
            if key in self._turns:  # a key that just had its turn waits behind the others
                self._turns.remove(key)
                self._turns.append(key)
            if self._entries.get(grammar) is entry:
                del self._entries[grammar]  # kept again below if it fits
            freed = False
            if error is None:
                entry.size = int(getattr(compiled, "memory_size_bytes", 0))
                freed = self._keep(grammar, entry)
            self._dispatch()
        if error is None:
            entry.future.set_result(compiled)
        else:
            entry.future.set_exception(error)  # not kept: the next request tries again
        if freed:
            del compiled
            self._trim()

    def _keep(self, grammar: Hashable, entry: _Entry) -> bool:
        """With the lock held: keep a compiled entry, evicting the least recently used ones over the
        budget (a held one moves to `held_bytes`); returns whether memory was freed."""
        if entry.size > self.budget_bytes:
            self._evictions += 1
            self._held_bytes += entry.size if entry.holders else 0
            return not entry.holders
        entry.kept = True
        self._entries[grammar] = entry
        self._bytes += entry.size
        freed = False
        for text in list(self._entries):
            if self._bytes <= self.budget_bytes:
                break
            old = self._entries[text]
            if old.kept and old is not entry:
                del self._entries[text]
                old.kept = False
                self._bytes -= old.size
                self._evictions += 1
                if old.holders:
                    self._held_bytes += old.size
                else:
                    freed = True
        return freed
