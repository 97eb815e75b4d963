"""Keep a CPU training process's heap from growing: glibc's ``malloc`` settings for PyTorch's large, varying tensors.

glibc serves a freed large block back from its heap instead of the kernel once its *dynamic* mmap threshold has
risen (it rises to the size of every freed mmapped block, up to 32 MiB), and every thread that allocates may get an
arena of its own. A trainer whose activations change size every step (the sequence lengths do) then fragments the
heap: SmolLM2-135M on ``examples/arith2`` (docs/learning.md) grew to 23 GB resident in 13 steps and was killed by
the kernel on a 24 GB machine; with a fixed 1 MiB mmap threshold and 2 arenas the same run stayed at 6-8 GB. This
module sets those two with ``mallopt`` (what ``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2`` do from the
environment); elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["return_freed_memory"]

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def return_freed_memory(mmap_threshold: int = 1 << 20, arenas: int = 2) -> bool:
    """Blocks of ``mmap_threshold`` bytes or more go back to the kernel when freed; at most ``arenas`` malloc arenas.

    Call it early (before threads allocate). True when glibc took both settings, False elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(_M_ARENA_MAX, int(arenas)))
