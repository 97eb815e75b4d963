"""A version held in a file rather than in memory (:class:`~psrl.weights.receivers.CollectiveVersions`): the
buckets of a version side by side in one file of the receiver's own disk, each received straight into its place
through a memory map of that bucket alone, and read back the same way.

Why a file: the ``hf`` engines of the driver's process must keep serving their version while the next one arrives
(a transfer that breaks midway must leave them on it), so a received version is held apart from their weights
until it is whole and checked -- in memory that is one more model's bytes per version held, beside the engines'
own. Through a map, a bucket's pages count in the process's memory only while that bucket is mapped (as it is
received, and as an engine copies it into its weights); the rest of the version sits in the page cache, which the
kernel writes back or drops. Nothing is copied on the way in (the transport receives into the map) and one copy
is made on the way out (into the engine's weights, as from memory).

A file is this process's: it is not a published version (no manifest; the receiver checked the digests as the
bytes arrived) and does not outlive the versions its receiver holds.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

__all__ = ["SpillFile"]

_PAGE = mmap.ALLOCATIONGRANULARITY


class SpillFile:
    """``path`` holding buckets of ``sizes`` bytes, in order, side by side (made at the full size, its blocks
    allocated)."""

    def __init__(self, path: str | Path, sizes: Sequence[int], create: bool = True):
        self.path = Path(path)
        self.sizes = [int(n) for n in sizes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                _allocate(f.fileno(), sum(self.sizes))

    def region(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s bytes, writable, as a ``uint8`` tensor over a map of that region alone: written
        through to the file; unmapped when the tensor and every view of it are gone."""
        with open(self.path, "r+b") as f:
            return _map(f.fileno(), self.offsets[index], self.sizes[index], mmap.ACCESS_WRITE)

    def regions(self) -> Iterator[torch.Tensor]:
        """Every bucket's bytes in order, read-only in effect (a private map: nothing is written back), one map
        at a time: the caller drops each before asking for the next. The file is opened here, before the first
        bucket is asked for, and held open throughout: a version dropped meanwhile (its file unlinked) is still
        read whole."""
        f = open(self.path, "rb")  # noqa: SIM115 -- closed by the generator below

        def read() -> Iterator[torch.Tensor]:
            with f:
                for offset, size in zip(self.offsets, self.sizes):
                    yield _map(f.fileno(), offset, size, mmap.ACCESS_COPY)

        return read()

    def rename(self, path: str | Path) -> SpillFile:
        """This file under ``path`` (``os.replace``)."""
        os.replace(self.path, path)
        return SpillFile(path, self.sizes, create=False)

    def discard(self) -> None:
        """Remove the file (a version no longer held, or one that did not arrive whole). Idempotent."""
        self.path.unlink(missing_ok=True)


def _allocate(fd: int, size: int) -> None:
    """Give the file its blocks now (``posix_fallocate``: extents only, ~2 ms for 1.6 GB here), so that a page
    written through the map needs none at its first write. Measured on this machine's ext4, 16 buckets of 64 MiB
    copied in through maps: 0.44 GB/s into a sparse file, 5.2 GB/s into allocated blocks; a large collective sync
    (``benchmarks/weights_scale.py --one large 2 collective``, twice each) 1.94 / 2.10 s before, 1.78 / 1.92 s
    after. Where the filesystem cannot, the file is made sparse at its size."""
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, size)


def _map(fd: int, offset: int, size: int, access: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    start = offset - offset % _PAGE  # a map starts on the allocation granularity
    mm = mmap.mmap(fd, size + offset - start, access=access, offset=start)
    return torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=offset - start)  # keeps ``mm`` alive
