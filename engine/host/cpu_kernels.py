"""The compiled CPU ops (kernels/cpu_ops.py) for this process: compiled once per machine into
`$FP4SERVE_CACHE/cpu-kernels/` (a folder per source, torch and CPU signature), loaded on first use;
without a working compiler the engine runs the pure-torch paths, and says why."""

from __future__ import annotations

import logging
import time

from engine.host.cache_folder import build_once, cache_root
from kernels.cpu_ops import LIBRARY_NAME, build_key, compile_library, load_library, ops_loaded

logger = logging.getLogger("fp4serve.cpu_kernels")


def load_cpu_ops() -> str | None:
    """None once the ops are loaded (compiling them first if this machine has no copy), else why
    they could not be (no compiler, a compile error), in one line."""
    if ops_loaded():
        return None
    folder = cache_root() / "cpu-kernels" / f"ops-{build_key()}"
    start = time.perf_counter()
    try:
        built = build_once(folder, compile_library)
        load_library(built / LIBRARY_NAME)
    except (RuntimeError, OSError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        logger.info("CPU ops (paged attention, norms, activation, RoPE) compiled in %.1f s into %s", elapsed, built)
    else:
        logger.info("CPU ops (paged attention, norms, activation, RoPE) loaded from %s", built)
    return None
