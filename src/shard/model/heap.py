"""The C heap while a stage loads: freed temporaries handed back to the OS, not kept.

Loading frees many tensor-sized temporaries (int8 and int4 packing inputs, float copies
quantized at load) between the blocks it keeps. glibc serves an allocation above its mmap
threshold from a fresh map, unmapped on free, but the threshold starts at 128 KiB and rises
to each such block freed (up to 32 MiB), so after the first few every temporary of a
loader-sized block comes from the heap, whose holes stay resident: after a stored SmolLM2
load, 170 MB of them, more than the weights (128 MB), and building its tied int8 head alone
left ~60 MB more at the peak. ``loading()`` pins the threshold at 1 MiB for the load (a
temporary of that size or more is unmapped when freed), then sets it to 32 MiB, where glibc's
own rule would have taken it, for what runs after; ``trim()`` (``malloc_trim``) returns the
heap's free pages. Elsewhere (no glibc) both do nothing.

Setting the threshold turns glibc's rule off for the trim threshold too, which then stays at
128 KiB: every free at the heap's top above that was handed back to the OS and the next
allocation faulted its pages in again. A forward's largest temporaries are its logits (Gemma
3's 9-row verify chunk: 9.4 MB, ~2,300 pages a call; 576,000 page faults in 300 calls, ~5 ms
of its ~44 at one thread, session 37). So after a load the trim threshold is set where
glibc's rule would have put it, twice the mmap threshold (64 MiB): up to that much free heap
stays mapped between forwards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

__all__ = ["loading", "trim"]

M_MMAP_THRESHOLD: Final = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD: Final = -1
LOAD_THRESHOLD: Final = 1 << 20
AFTER_THRESHOLD: Final = 32 << 20
LOAD_TRIM: Final = 128 << 10  # glibc's default
AFTER_TRIM: Final = 2 * AFTER_THRESHOLD


def _libc(symbol: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), symbol)
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``)."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


@contextmanager
def loading() -> Iterator[None]:
    """Temporaries of 1 MiB or more unmapped when freed while the block loads (module
    docstring); the heap trimmed on the way out, and up to 64 MiB of free heap kept mapped
    after."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, LOAD_TRIM)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, AFTER_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)
        trim()
