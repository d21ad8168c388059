"""Running small CPU work on the calling thread only: torch's OpenMP parallel regions cost more
than they save on the few-microsecond ops of a small decode batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Decode batches up to this many tokens run their elementwise MLP activation on one thread.
SERIAL_ELEMENTWISE_TOKENS = 64


@contextmanager
def serial_cpu_ops(enabled: bool = True) -> Iterator[None]:
    """Run torch's CPU ops on the calling thread only, inside the block.

    NOTE: torch splits elementwise ops over ~32k elements, batched matmuls and even a one-row
    index_copy_ over its OpenMP threads. In a small decode batch those are parallel regions of a
    few microseconds of work each, and waking the passive worker costs more than the work: one
    batch-1 layer's attention took 61-130 us with 2 threads against 34 us with 1, 30 layers'
    SwiGLU at batch 32 1.26 ms against 0.64 (best of 12; docs/PERF.md). Setting the thread count
    is a few hundred nanoseconds."""
    if not enabled or torch.compiler.is_compiling():  # a compiled graph keeps torch's threading
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
