"""The weights a CPU decode step streams from memory (int4 codes, scales and zeros, the int8 lm_head)
moved into one buffer the kernel backs with transparent huge pages (2 MiB).

Why: at one row a decode step reads every int4 layer and the int8 head once (~90 MiB on SmolLM2),
spread over ~23,000 4 KiB pages; from huge pages the head and the whole step read faster
(docs/PERF.md "The int4 kernel, the int8 head's prefetch and huge pages"). Linux gives an anonymous
mapping huge pages on first touch
only when madvise(MADV_HUGEPAGE) came first (THP in "madvise" mode, the common default), so the
tensors are copied into a fresh, advised buffer; torch's own allocations are never advised.
Where THP is off, or this is not Linux, nothing moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch
from torch import Tensor, nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_ALIGN = 64  # each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), None where unknown."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def _madvise_huge(address: int, length: int) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_buffer(nbytes: int) -> tuple[Tensor, int] | None:
    """A uint8 tensor with at least `nbytes` from an offset that starts a huge page, the range
    advised for huge pages before anything touched it: (buffer, offset). None where madvise fails."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr()
    start = -base % HUGE_PAGE
    length = (raw.nbytes - start) // HUGE_PAGE * HUGE_PAGE
    if not _madvise_huge(base + start, length):
        return None
    return raw, start


def move_to_huge_pages(slots: list[tuple[nn.Module, str]]) -> int:
    """Copy the buffers `slots` name ((module, buffer name), in the order a step reads them; e.g.
    int4_linear.cpu_streamed_weights) into one huge-page buffer, in that order, and point the
    modules at the copies; the bytes moved (0 where THP is off or madvise fails). Before anything
    else keeps references to those buffers (decoder.use_fused_layers)."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    tensors = [getattr(m, name) for m, name in slots]
    if not tensors or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return 0
    total = sum(-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors)
    made = huge_page_buffer(total)
    if made is None:
        return 0
    raw, offset = made
    for (module, name), t in zip(slots, tensors):
        copy = raw[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        module._buffers[name] = copy  # the buffer, not a parameter: no autograd state to keep
        offset += -(-t.nbytes // _ALIGN) * _ALIGN
    return total
