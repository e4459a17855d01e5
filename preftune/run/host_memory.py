"""Host memory for training on a CPU: glibc's malloc keeps what one pass frees for the next.

By default glibc returns large blocks to the kernel as soon as they are freed: blocks above a
threshold (128 KiB, raised as such blocks are freed, never above 32 MiB) are mmap-ed and
munmap-ed one by one, and the heap's free top is trimmed once it exceeds twice that threshold. A
training step frees all its activations at the end and allocates them again in the next step,
so every step starts on fresh pages, which the kernel faults in and zeroes 4 KiB at a time. Keeping
freed memory in the heap (blocks up to 32 MiB from the heap, no trimming below 1 GiB) saves those
faults (measured in bench/bench_passes.py). What is kept is what a pass had already used, but
the kept heap fragments: the peak resident size of one run can exceed its live tensors, and by a
different amount from run to run (docs/plan.md).

Applied once per process, only with glibc, and not where the user chose: any `MALLOC_*` or
`GLIBC_TUNABLES` variable, or another allocator in `LD_PRELOAD` (jemalloc, tcmalloc, mimalloc).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("preftune")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
SETTINGS = {
    # the largest glibc accepts on 64-bit: smaller blocks come from the heap
    M_MMAP_THRESHOLD: 32 << 20,
    M_TRIM_THRESHOLD: 1 << 30,  # keep up to 1 GiB of freed heap top for the next pass
    M_TOP_PAD: 64 << 20,  # grow the heap 64 MiB at a time (pages are touched only when used)
}
_applied: bool | None = None


def user_chose(environ=os.environ) -> bool:
    """Did the user tune malloc or preload another allocator?"""
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in environ):
        return True
    return any(name in environ.get("LD_PRELOAD", "") for name in ("jemalloc",
                                                                  "tcmalloc", "mimalloc"))


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring); True if it now does."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_chose():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
    log.debug("malloc keeps freed memory: %s", _applied)
    return _applied
