"""Keep a CPU training process's heap from growing: glibc's ``malloc`` told to give freed memory back, cheaply.

glibc serves a freed large block back from its heap instead of the kernel once its *dynamic* mmap threshold has
risen (it rises to the size of every freed mmapped block, up to 32 MiB), and every thread that allocates may get an
arena of its own. A trainer whose activations change size every step (the sequence lengths do) then fragments the
heap: SmolLM2-135M on ``examples/arith2`` (docs/learning.md) grew to 23 GB resident in 13 steps and was killed by
the kernel on a 24 GB machine.

A fixed 1 MiB mmap threshold kept that run at 6-8 GB, but it made every tensor of 1 MiB or more an ``mmap`` /
``munmap`` pair whose pages the kernel zeroes again at each use: the default job, whose churn is blocks of 1-4 MiB,
spent a quarter of its wall time in the kernel for it (issue #33, item 6). So instead:

* :func:`return_freed_memory` (once, at start): a fixed mmap threshold of :data:`MMAP_THRESHOLD` (8 MiB: no longer
  rising to 32 MiB; the heap's top trimmed past twice that) and at most 2 malloc arenas (threads share them instead
  of each fragmenting its own);
* :func:`release_freed`: ``malloc_trim(0)``, which gives the kernel back every whole free page of every arena --
  not only the top of the heap -- so what one phase freed does not stay resident under the next. A rank
  (:class:`~psrl.train.worker.RankWorker`) calls it after its pre-update log-prob forwards (the training forward,
  where a step peaks, then starts from a trimmed heap) and after every training step; at world size > 1 the driver
  (:class:`~psrl.train.Trainer`) after every step too.

``benchmarks/heap_cost.py`` measures it against no setting and the 1 MiB threshold (``docs/results/heap_cost_*``).
Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = ["return_freed_memory", "release_freed"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 8 << 20
"""Blocks of this size or more are mmapped (given back to the kernel when freed); smaller ones are reused from the
heap. The default job's churn is blocks of 1-4 MiB (~25 GB a step, ``strace`` of its ``munmap`` calls): those stay
in the heap; SmolLM2's larger activations do not."""


@functools.cache
def _libc() -> Any:
    """glibc with ``mallopt`` and ``malloc_trim``, or None (not Linux, musl and others)."""
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


def return_freed_memory(arenas: int = 2, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """At most ``arenas`` malloc arenas; blocks of ``mmap_threshold`` bytes or more mmapped, and the heap's top given
    back past twice that (glibc's own ratio). Call it early (before threads allocate). True when glibc took them."""
    libc = _libc()
    if libc is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, 2 * mmap_threshold), (_M_ARENA_MAX, arenas))
    return all([bool(libc.mallopt(key, int(value))) for key, value in settings])


def release_freed() -> bool:
    """Every whole free page of the heap back to the kernel (``malloc_trim(0)``); between steps, never in a hot loop.
    True when glibc returned some memory."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
