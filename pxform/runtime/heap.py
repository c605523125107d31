"""Keeping the host heap's pages from one step to the next (glibc, CPU ranks).

On a GPU, torch's caching allocator keeps the blocks a step freed, and the next step
reuses them. On a CPU, tensors come from glibc's `malloc`, which by default gives memory
back to the system as it is freed: the top of the heap is trimmed once more than its
(adaptive) trim threshold is free, and blocks over the (adaptive) mmap threshold are
unmapped on free. The next step then faults the same pages in again, about 0.3 ms per
MiB on the 2-core machine the cost model is calibrated on. How much a step faults depends
on the order and sizes of its frees, not on its peak: GPT small's zero-bubble last stage
faulted 18-22 MiB a step where 1F1B's faulted 0-2 MiB at a higher peak
(`docs/benchmarks/stability.md`), so no price drawn from the plan can follow it.

`keep_pages` makes the CPU heap behave like the caching allocator: freed memory stays
with the process, and a step's working set is faulted in once. A rank's resident set then
stays at its peak, which is what the memory model prices (and what a GPU rank holds).
The runtime calls it when a CPU mesh is built and when `calibrate` measures a CPU, so the
profile and the steps it prices see the same heap.

It leaves glibc alone when:
- `PXFORM_KEEP_HEAP=0` is set (the way to opt out);
- glibc's own `MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TOP_PAD_` or
  `MALLOC_MMAP_MAX_`, or a `glibc.malloc` entry in `GLIBC_TUNABLES`, is set: the user
  (or a test reading `VmHWM`, which needs freed tensors to leave the resident set) chose
  the heap's behaviour;
- the C library is not glibc (nothing to tune the same way).

Example:
    >>> from pxform.runtime import heap
    >>> heap.keep_pages().kept          # on Linux with glibc, nothing overriding it
    True
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

OPT_OUT = "PXFORM_KEEP_HEAP"
"""Set to 0 to leave glibc's heap thresholds as they are."""

# glibc's own knobs: with any of them set, the user chose the heap's behaviour
_GLIBC_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20
"""Blocks under this come from the heap (and stay there when freed); glibc's largest
allowed value on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`). Its adaptive threshold climbs to
the same value after a few frees; fixing it from the start stops it moving."""


@dataclass(frozen=True)
class HeapState:
    """What `keep_pages` did in this process: `kept` (the thresholds are set) and why not
    when it did not."""

    kept: bool
    reason: str


_state: HeapState | None = None


def keep_pages() -> HeapState:
    """Keep freed host memory in this process instead of giving it back to the system
    (glibc: no trimming of the heap top, a fixed 32 MiB mmap threshold). Decided on the
    first call and then the same for the life of the process; every later call returns
    the first answer at once.

    Example:
        >>> keep_pages()
        HeapState(kept=True, reason='glibc: heap top never trimmed, mmap threshold 32 MiB')
    """
    global _state
    if _state is None:
        _state = _decide()
    return _state


def state() -> HeapState | None:
    """What `keep_pages` did, or None when it was not called in this process."""
    return _state


def _decide() -> HeapState:
    if os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return HeapState(False, f"{OPT_OUT}={os.environ[OPT_OUT]}: left as the system has it")
    chosen = [v for v in _GLIBC_VARS if v in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return HeapState(False, f"{', '.join(chosen)} set: glibc's heap left as chosen")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return HeapState(False, "not glibc: heap left as the system has it")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return HeapState(False, "glibc without mallopt: heap left as it is")
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # -1 turns trimming off (mallopt(3)); both calls return 1 on success
    if mallopt(_M_TRIM_THRESHOLD, -1) != 1 or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return HeapState(False, "glibc refused the thresholds: heap left as it is")
    return HeapState(True, f"glibc: heap top never trimmed, mmap threshold "
                           f"{MMAP_THRESHOLD // 2**20} MiB")
