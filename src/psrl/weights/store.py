"""Where the engines read published versions (:class:`psrl.types.WeightSource`), by transport:

* :class:`ParameterStore` -- in memory, for world size 1 with ``hf`` engines in the driver's own process: the
  trainer's rank (the same process) hands each version over as CPU tensors. It keeps the newest version and the one
  before it (an engine may be loading it while the next is published; engines always load the newest), not
  ``staleness + 2`` copies: a version nobody can still load is not held.
* :class:`FileVersions` -- ``ROOT/v{N}`` directories the ranks wrote (:mod:`psrl.weights.publish`): the driver
  holds no weights; an ``hf`` engine reads a version when it loads it (checked against the manifest), a vLLM
  server or a Ray engine actor reads the directory itself.

Thread-safe: publication runs in the trainer's thread while the event loop's engines read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor

from psrl.types import WeightSource
from psrl.weights.format import read_manifest, read_version, versions

__all__ = ["ParameterStore", "FileVersions", "VersionDirectories", "StreamedVersions"]


class ParameterStore:
    """``publish(version, state)``, ``latest_version()``, ``versions()``, ``get(version=None) -> (version, state)``.

    States are shared, not copied, on ``get``: treat them as read-only (``load_state_dict`` copies into the model).
    """

    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError(f"ParameterStore keep must be >= 1, got {keep}")
        self.keep = int(keep)
        self._lock = threading.Lock()
        self._states: OrderedDict[int, dict[str, Tensor]] = OrderedDict()

    def publish(self, version: int, state: dict[str, Tensor]) -> None:
        """Hold ``state`` as ``version``; versions must strictly increase. Drops versions beyond ``keep``."""
        with self._lock:
            latest = next(reversed(self._states)) if self._states else None
            if latest is not None and version <= latest:
                raise ValueError(f"publish version {version} <= latest published version {latest}")
            self._states[int(version)] = state
            while len(self._states) > self.keep:
                self._states.popitem(last=False)

    def latest_version(self) -> int | None:
        """Newest published version, or None before the first publish."""
        with self._lock:
            return next(reversed(self._states)) if self._states else None

    def versions(self) -> list[int]:
        """The versions still held, oldest first."""
        with self._lock:
            return list(self._states)

    def get(self, version: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """``(version, state)`` of ``version`` (default: the newest); ``KeyError`` if not held."""
        with self._lock:
            if not self._states:
                raise KeyError("ParameterStore is empty: nothing has been published yet")
            if version is None:
                version = next(reversed(self._states))
            if version not in self._states:
                raise KeyError(f"version {version} is not held (held: {list(self._states)})")
            return version, self._states[version]


@runtime_checkable
class VersionDirectories(WeightSource, Protocol):
    """A weight source whose versions are directories (what vLLM's ``reload_weights`` and Ray actors read)."""

    root: Path

    def directory(self, version: int) -> Path:
        """``ROOT/v{version}`` (a complete version; ``KeyError`` if there is none)."""


@runtime_checkable
class StreamedVersions(WeightSource, Protocol):
    """A weight source that gives a version bucket by bucket, checked already (what the driver's ``hf`` engines read
    from :class:`~psrl.weights.receivers.CollectiveVersions`); ``name`` is what errors call it."""

    name: str

    def names(self, version: int) -> list[str]:
        """The tensors of ``version`` its buckets hold, in order (``KeyError`` if it is not held)."""

    def tied(self, version: int) -> dict[str, str]:
        """``{alias: canonical}``: names of ``version`` that its buckets do not hold (a tied tensor comes once)."""

    def buckets(self, version: int) -> Iterator[dict[str, Tensor]]:
        """``version``'s tensors, a bucket at a time (views: copy what is kept before the next)."""


class FileVersions:
    """The versions under ``root`` that the trainer's ranks published; nothing is held in memory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def latest_version(self) -> int | None:
        have = versions(self.root)
        return have[-1] if have else None

    def versions(self) -> list[int]:
        return versions(self.root)

    def directory(self, version: int) -> Path:
        d = self.root / f"v{int(version)}"
        try:
            read_manifest(d)
        except FileNotFoundError:
            raise KeyError(f"version {version} is not published under {self.root} (held: {self.versions()})") from None
        return d

    def get(self, version: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """Read ``version`` (default: the newest) from disk, every bucket checked against the manifest."""
        if version is None:
            version = self.latest_version()
            if version is None:
                raise KeyError(f"nothing is published under {self.root} yet")
        return read_version(self.directory(version))
