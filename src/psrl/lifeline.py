"""A child process's tie to the process that started it (the trainer ranks'; standard library only).

:func:`run` is what a rank process runs first, before anything heavy is imported (torch takes seconds to import,
and a driver may die meanwhile): it asks the kernel to SIGKILL it when the parent's thread that started it ends
(``PR_SET_PDEATHSIG``, Linux), exits at once if the parent is already gone, and starts a side thread that beats a
shared counter while the process lives (:func:`beat`) -- only then does it unpickle and call the real target.
The parent pid is passed in, not read in the child with ``getppid()``: a parent that died before the child read
it would leave the child watching the wrong process.

:func:`own_directory` ties a temporary directory to the object that owns it the same way: it goes when its owner
does (a trainer, a rank group or a weight receiver given no directory of the run's).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = ["run", "die_with_parent", "beat", "own_directory"]

_PR_SET_PDEATHSIG = 1


def run(parent: int, beats: Any, slot: int, every: float, payload: bytes, *args: Any) -> None:
    """Die with ``parent``, beat ``beats[slot]`` every ``every`` seconds, then ``fn(*args, *more)`` for
    ``(fn, more) = pickle.loads(payload)`` (``args``: what only the spawning pickler carries, such as pipes)."""
    die_with_parent(parent)
    threading.Thread(target=beat, args=(parent, beats, slot, every), daemon=True, name="psrl-heartbeat").start()
    fn, more = pickle.loads(payload)
    fn(*args, *more)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread of ``parent`` that started it ends, then exit at once
    if ``parent`` is already gone (it died before the signal was asked for)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def beat(parent: int, beats: Any, slot: int, every: float) -> None:
    """The side thread: add one to ``beats[slot]`` every ``every`` seconds -- it runs while the process computes or
    waits in a collective, not when the process is stopped or hung, so the parent tells a silent child from a busy
    one -- and exit the process when it is re-parented (the parent died; a child blocked in a collective is not
    waited for)."""
    tick = threading.Event()
    due = time.monotonic()
    while os.getppid() == parent:
        if time.monotonic() >= due:
            beats[slot] += 1
            due = time.monotonic() + every
        tick.wait(min(every, 1.0))
    os._exit(1)


def own_directory(owner: object, prefix: str) -> Path:
    """A new temporary directory (named ``prefix...``) for ``owner``, removed when ``owner`` is collected or at
    exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    weakref.finalize(owner, shutil.rmtree, path, True)
    return Path(path)
