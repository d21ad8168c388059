"""`GrammarCache`: compiled grammars by their text, bounded by bytes, and the compiles that fill it.

- Each entry is charged xgrammar's own size of the compiled grammar (`memory_size_bytes`); least
  recently used entries leave once the total passes the budget, and a grammar larger than the whole
  budget is served but not kept. A grammar held by a live request stays in memory until the request
  ends, cached or not.
- Compiles run on a small pool of threads (xgrammar releases the GIL while it compiles). Each key
  compiles one grammar at a time and keys take turns, so a key that sends many large schemas delays
  only its own requests: another key's schema waits at most for the compiles already running.
- A compile that nobody waits for any more (its requests were aborted before it started) is dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import DEFAULT_GRAMMAR_CACHE_BYTES
from engine.core_types import GrammarCacheStats

logger = logging.getLogger("fp4serve.structured")

DEFAULT_COMPILE_WORKERS = 2  # a small pool: the cores belong to the model


@dataclass(eq=False)
class _Entry:
    future: Future[Any]
    key: str  # the API key whose request asked first: whose turn the compile takes
    waiters: int = 1  # prepared requests not yet running; a compile with none left is dropped unstarted
    started: bool = False
    size: int = 0  # bytes charged, once compiled and kept
    kept: bool = field(default=False)  # compiled and charged to the budget


def _release_freed_memory() -> Callable[[], None]:
    """glibc's malloc_trim, else nothing. NOTE: glibc keeps a freed grammar's pages in its arenas
    (one per compile thread) instead of returning them; after an eviction the resident size would
    stay at its peak."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return lambda: None
    return lambda: trim(0)


class GrammarCache:
    """Thread-safe: `get` and `release` run on the engine's thread, compiles on the pool's."""

    def __init__(self, compile_fn: Callable[[str], Any], budget_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 num_workers: int = DEFAULT_COMPILE_WORKERS) -> None:
        assert budget_bytes >= 0 and num_workers >= 1, f"budget {budget_bytes}, workers {num_workers}"
        self.budget_bytes = budget_bytes
        self._compile_fn = compile_fn
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # grammar text -> entry, least recent first
        self._queues: dict[str, deque[str]] = {}  # key -> grammars waiting to start, in arrival order
        self._turns: deque[str] = deque()  # keys with grammars waiting, next turn first
        self._compiling: set[str] = set()  # keys with a compile running
        self._executor: ThreadPoolExecutor | None = None
        self._trim = _release_freed_memory()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def get(self, grammar: str, key: str) -> Future[Any]:
        """The grammar compiled, compiling, or queued for `key`'s next turn; each call is one waiter
        until `release`."""
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is not None:
                self._entries.move_to_end(grammar)
                entry.waiters += 1
                self._hits += 1
                return entry.future
            self._misses += 1
            entry = self._entries[grammar] = _Entry(Future(), key)
            self._queues.setdefault(key, deque()).append(grammar)
            if key not in self._turns:
                self._turns.append(key)
            self._dispatch()
            return entry.future

    def release(self, grammar: str, future: Future[Any]) -> None:
        """A waiter of `get` no longer wants the grammar (its request ended before it ran)."""
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is None or entry.future is not future or entry.started:
                return
            entry.waiters -= 1
            if entry.waiters > 0:
                return
            del self._entries[grammar]
            queue = self._queues.get(entry.key)
            if queue is not None and grammar in queue:
                queue.remove(grammar)
            future.cancel()

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(
                num_bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                num_entries=sum(1 for e in self._entries.values() if e.kept),
                num_compiling=len(self._compiling),
                num_queued=sum(len(q) for q in self._queues.values()),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- internals (the lock held where it says so) ---------------------------------------------
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

    def _run(self, grammar: str, key: str, entry: _Entry) -> None:
        """On a pool thread: compile, charge, evict, then start the next compile."""
        compiled: Any = None
        error: BaseException | None = None
        try:
            compiled = self._compile_fn(grammar)
        except BaseException as e:  # noqa: BLE001 - handed to the waiters through the future
            error = e
        evicted: list[_Entry] = []
        with self._lock:
            self._compiling.discard(key)
            if key in self._turns:  # a key that just had its turn waits behind the others
                self._turns.remove(key)
                self._turns.append(key)
            if self._entries.get(grammar) is entry:
                if error is None:
                    evicted = self._charge(grammar, entry, int(getattr(compiled, "memory_size_bytes", 0)))
                else:
                    del self._entries[grammar]  # a failure is not kept: the next request tries again
            self._dispatch()
        if error is None:
            entry.future.set_result(compiled)
        else:
            entry.future.set_exception(error)
        if evicted:
            logger.debug("grammar cache: %d evicted, %d bytes kept of %d", len(evicted), self._bytes, self.budget_bytes)
            del evicted, compiled  # the last references, unless a live request holds one
            self._trim()

    def _charge(self, grammar: str, entry: _Entry, size: int) -> list[_Entry]:
        """With the lock held: keep the entry and evict the least recently used ones over the budget;
        returns the evicted ones."""
        evicted = []
        if size > self.budget_bytes:
            del self._entries[grammar]
            self._evictions += 1
            evicted.append(entry)
            return evicted
        entry.size, entry.kept = size, True
        self._bytes += size
        for text in list(self._entries):
            if self._bytes <= self.budget_bytes:
                break
            old = self._entries[text]
            if old.kept and old is not entry:
                del self._entries[text]
                self._bytes -= old.size
                self._evictions += 1
                evicted.append(old)
        return evicted
