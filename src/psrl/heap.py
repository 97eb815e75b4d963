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
  rising to 32 MiB; the heap's top trimmed past twice that), at most 2 malloc arenas (threads share them instead
  of each fragmenting its own), and the process's :class:`FreedPages` watcher;
* :func:`release_freed`: ``malloc_trim(0)``, which gives the kernel back every whole free page of every arena --
  not only the top of the heap -- so what one phase freed does not stay resident under the next. A rank
  (:class:`~psrl.train.worker.RankWorker`) calls it after its pre-update log-prob forwards and after every
  training step; at world size > 1 the driver (:class:`~psrl.train.Trainer`) after every step too;
* :class:`FreedPages`: within a step, the training forward's activations of 1-8 MiB (kept for the backward,
  between temporaries freed) fragment the heap -- SmolLM2 peaked ~0.45 GB above the 1 MiB threshold's peak
  before this watcher. It trims when resident memory reaches a new high while the freed pages held are 64 MiB
  above the last trim's: freed pages cannot raise the peak, and below it they stay for the heap to reuse
  (trimming whenever 64 MiB were held made the default job trim about a hundred times a step, each trim's pages
  faulted in again: as slow as the 1 MiB threshold).

``benchmarks/heap_cost.py`` measures it against no setting and the 1 MiB threshold (``docs/results/heap_cost_*``).
Elsewhere than glibc all of it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from typing import Any

__all__ = ["return_freed_memory", "release_freed", "FreedPages", "held_free"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

watcher: FreedPages | None = None
"""The process's :class:`FreedPages`, started by :func:`return_freed_memory`."""

MMAP_THRESHOLD = 8 << 20
"""Blocks of this size or more are mmapped (given back to the kernel when freed); smaller ones are reused from the
heap. The default job's churn is blocks of 1-4 MiB (~25 GB a step, ``strace`` of its ``munmap`` calls): those stay
in the heap; SmolLM2's larger activations do not."""


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")]
    _fields_ += [(name, ctypes.c_size_t) for name in ("fsmblks", "uordblks", "fordblks", "keepcost")]


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
        libc.mallinfo2.restype = _Mallinfo2
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
    took = all([bool(libc.mallopt(key, int(value))) for key, value in settings])
    global watcher
    if watcher is None or watcher.pid != os.getpid():  # a forked child has the global but not the thread
        watcher = FreedPages()
    return took


def release_freed() -> bool:
    """Every whole free page of the heap back to the kernel (``malloc_trim(0)``); between steps, never in a hot loop.
    True when glibc returned some memory."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _anon() -> int:
    """This process's anonymous resident bytes (``/proc/self/statm``: resident less file-backed and shared)."""
    with open("/proc/self/statm", "rb") as f:
        _, resident, shared = f.read().split()[:3]
    return (int(resident) - int(shared)) * _PAGE


def held_free(anon: int | None = None) -> int | None:
    """This process's anonymous resident bytes (``anon``, read now if None) not in a live ``malloc`` block (in use
    in an arena, or mmapped): freed heap pages still resident, plus a slowly varying rest (Python's own arenas,
    thread stacks). None off glibc."""
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return (_anon() if anon is None else anon) - info.uordblks - info.hblkhd


class FreedPages:
    """Keeps freed heap pages from raising the process's peak: trims when its resident memory reaches a new high
    while the freed pages it holds are ``limit`` bytes above what it held after its last trim.

    :meth:`check` does it once; a side thread (``every_s`` seconds apart; None: no thread, the caller checks) runs
    it. A trainer's activations then need no ``mmap`` each (an ``mmap`` / ``munmap`` pair whose pages the kernel
    zeroes again at every use) for a step's peak to stay near its live bytes. Below the peak it holds what it
    freed: a job that churns under its own earlier high (the default job's steps, after the first) is not trimmed,
    since each trim's pages are faulted in again when the heap reuses them. :attr:`trims` counts the trims;
    :meth:`stop` ends the thread."""

    def __init__(self, limit: int = 64 << 20, every_s: float | None = 0.01):
        self.limit, self.trims, self.pid = limit, 0, os.getpid()
        self.floor = held_free()
        """:func:`held_free` after the last trim, or its lowest since (Python's own memory may shrink too)."""
        self.high = _anon()
        """The highest anonymous resident memory seen (bytes)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if every_s is not None and self.floor is not None:
            self._thread = threading.Thread(target=self._watch, args=(every_s,), name="psrl-freed-pages", daemon=True)
            self._thread.start()

    def check(self) -> bool:
        """Trim when resident memory is at a new high and the freed pages held rose more than ``limit`` above
        :attr:`floor`; True when it trimmed."""
        anon = _anon()
        held = held_free(anon)  # one read of /proc/self/statm per check: the watcher checks 100 times a second
        if held is None or self.floor is None:
            return False
        trimmed = anon > self.high and held > self.floor + self.limit
        self.high = max(self.high, anon)
        if trimmed:
            release_freed()
            self.trims += 1
            held = held_free()
            assert held is not None
        self.floor = held if trimmed else min(self.floor, held)
        return trimmed

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
