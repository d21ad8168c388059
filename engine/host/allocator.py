"""The C allocator of the engine process: freed memory goes back to the OS when the engine idles.

Why: torch's CPU tensors, xgrammar's compiled grammars and the tokenizer the grammar compiler loads
all come from glibc's malloc, which keeps what is freed inside its arenas (one per thread that
allocates, and the engine has several: the step loop, the pipe reader, the grammar compiler, the
OpenMP workers). After a burst of long prompts the engine stayed a few hundred MiB above what it
holds (docs/PERF.md "Engine memory under an agent mix"). `malloc_trim(0)` returns every arena's free
pages; it runs when the loop goes idle after work, so no step ever waits for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger("fp4serve.engine")


def memory_releaser() -> Callable[[], None] | None:
    """`malloc_trim(0)` of this process's C library, or None where it has none (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release
