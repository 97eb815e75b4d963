"""Keep a CPU training process's heap from growing, without paying for it on every tensor: glibc's ``malloc``.

glibc serves a freed large block back from its heap instead of the kernel once its *dynamic* mmap threshold has
risen (it rises to the size of every freed mmapped block, up to 32 MiB), and every thread that allocates may get an
arena of its own. A trainer whose activations change size every step (the sequence lengths do) then fragments the
heap: SmolLM2-135M on ``examples/arith2`` (docs/learning.md) grew to 23 GB resident in 13 steps and was killed by
the kernel on a 24 GB machine.

A fixed 1 MiB mmap threshold (``MALLOC_MMAP_THRESHOLD_=1048576``) kept that run at 6-8 GB, but it makes every
tensor above 1 MiB a fresh ``mmap`` whose pages fault in one by one and a ``munmap`` on free: the built-in job
ran 1.27x slower with it (wall 114 s against 88 s on 25 synchronous steps; sys time 29.8 s against 4.7 s, issue
#33). So the threshold is left to glibc (freed blocks are reused from the heap, faulted in once), and instead:

* :func:`return_freed_memory` caps the arenas at 2 (``MALLOC_ARENA_MAX=2``): a thread's allocations do not get a
  heap of their own to fragment;
* :func:`trim` (``malloc_trim(0)``) hands every whole free page of every arena back to the kernel; the trainer
  calls it after each command of a step (:meth:`psrl.train.worker.RankWorker.handle`), so what a step freed is
  returned once per step, not once per tensor, and the heap never carries one step's fragments into the next.

Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

__all__ = ["return_freed_memory", "trim"]

_M_ARENA_MAX = -8


@cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where there is none (not Linux; musl and others have no ``mallopt`` / ``malloc_trim``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory(arenas: int = 2) -> bool:
    """At most ``arenas`` malloc arenas. Call it early (before threads allocate); then :func:`trim` between steps.

    True when glibc took the setting, False elsewhere.
    """
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))


def trim() -> bool:
    """Return every whole free page of the heap to the kernel (``malloc_trim(0)``); True when some memory was
    released, False when none was or elsewhere than glibc."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
