"""Where versions sent over the collective transport (:mod:`psrl.weights.collective`) are held, by receiver:

* :class:`CollectiveVersions` -- this process receives (the ``hf`` engines of the driver): it holds a version's
  tensors once every bucket arrived and matched the writer's digests;
* :class:`SentVersions` -- receivers in other processes (vLLM servers' workers, :mod:`psrl.weights.vllm_receiver`)
  staged it: the driver keeps the writer's manifest only, and an engine asks its receiver to load.

A :class:`Receiver` is a member of the transfer group on the receiving side, as the trainer's publisher
(:mod:`psrl.train.transfer`) drives it: ``join``, then per version ``receive`` (the digests it computed), then
``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from psrl.weights.collective import (
    BucketLayout,
    GroupAddress,
    TransferFailed,
    TransferGroup,
    check_received,
    receive_version,
)
from psrl.weights.format import with_tied
from psrl.weights.store import FileVersions, ParameterStore

__all__ = ["Receiver", "CollectiveVersions", "SentVersions"]


class Receiver(Protocol):
    """A receiving member of the transfer group (module docstring); ``name`` is what errors call it."""

    @property
    def name(self) -> str:
        """What errors call it."""

    def join(self, address: GroupAddress, rank: int) -> None:
        """Become group rank ``rank`` (blocks until every member joined)."""

    def receive(self, version: int, buckets: Sequence[BucketLayout], world: int) -> list[str]:
        """Receive ``version`` from the ``world`` trainer ranks, staged apart from what engines serve; the digests
        of its buckets as received."""

    def close(self) -> None:
        """Leave the group."""


class CollectiveVersions:
    """The versions received over the transfer group into this process, for the ``hf`` engines here (a
    :class:`psrl.types.WeightSource`): a version is held -- and engines can load it -- only once every bucket has
    arrived and matched the writer's digests. Holds the newest ``keep`` versions (:class:`ParameterStore`).

    One receiver per process: the driver's ``hf`` engines share what it received (they read it as they read the
    in-memory store). ``name`` is what errors call it."""

    def __init__(self, keep: int = 2, name: str = "the driver's hf engines"):
        self.name = name
        self._held = ParameterStore(keep)
        self.group: TransferGroup | None = None
        self._lock = threading.Lock()
        self._staged: tuple[int, dict[str, torch.Tensor], list[str]] | None = None

    def join(self, address: GroupAddress, rank: int) -> None:
        """Become group rank ``rank`` (blocks until every member joined)."""
        group = TransferGroup(address, rank)
        with self._lock:
            self.group = group

    def receive(self, version: int, buckets: Sequence[BucketLayout], world: int) -> list[str]:
        """Receive ``version`` from the ``world`` trainer ranks: its bucket digests; the version is staged, not
        yet held (:meth:`commit` holds it once checked). :class:`TransferFailed` when a bucket does not arrive."""
        if self.group is None:
            raise TransferFailed(f"{self.name}: version {version}: not in a transfer group (join first)")
        state: dict[str, torch.Tensor] = {}
        digests: list[str] = []
        try:
            for _, tensors, digest in receive_version(self.group, buckets, world):
                state.update(tensors)
                digests.append(digest)
        except RuntimeError as exc:  # gloo: a peer gone, a timeout
            raise TransferFailed(
                f"{self.name}: version {version} failed after {len(digests)} of {len(buckets)} buckets: {exc}"
            ) from exc
        with self._lock:
            self._staged = (int(version), state, digests)
        return digests

    def commit(self, version: int, manifest: Mapping) -> None:
        """Hold the staged ``version`` for the engines once its digests match the writer's ``manifest`` (else
        :class:`~psrl.weights.format.VersionDamaged`, and nothing changes)."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None or staged[0] != int(version):
            raise KeyError(f"{self.name}: version {version} is not staged")
        check_received(self.name, version, staged[2], manifest)
        self._held.publish(int(version), with_tied(staged[1], manifest.get("tied", {})))  # aliases: not sent

    def close(self) -> None:
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ WeightSource

    def latest_version(self) -> int | None:
        return self._held.latest_version()

    def versions(self) -> list[int]:
        return self._held.versions()

    def get(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        return self._held.get(version)


class SentVersions:
    """The versions the ranks sent to receivers in other processes (vLLM servers' workers, which stage them): the
    writer's manifests only, no tensor (a :class:`psrl.types.WeightSource` without states). An engine loads a
    sent version by naming it and its digest to its receiver, which checks what it staged before loading.

    A version the ranks published as files instead (``root/v{N}``: the run's first version, before the servers
    have started and joined) is read from its directory (:class:`~psrl.weights.store.VersionDirectories`)."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = max(int(keep), 1)
        self._lock = threading.Lock()
        self._manifests: dict[int, dict] = {}
        self._files = FileVersions(self.root)
        self._published: set[int] = set()
        """Versions the ranks published as files into ``root`` for this store (not a resumed run's older ones)."""
        self.write_files: Callable[[int], None] | None = None
        """Writes a sent version as files into ``root`` (the trainer's ranks, while they hold it): what
        :meth:`directory` asks for when a sent version has no directory (``final/``, validation servers)."""

    def commit(self, version: int, manifest: Mapping) -> None:
        """``version`` was received whole by every receiver (their digests matched ``manifest``)."""
        with self._lock:
            self._manifests[int(version)] = dict(manifest)
            for old in sorted(self._manifests)[: -self.keep]:
                del self._manifests[old]

    def commit_files(self, version: int) -> None:
        """``version`` was published as files (``root/v{version}``)."""
        with self._lock:
            self._published.add(int(version))

    def sent(self, version: int) -> bool:
        """Whether ``version`` went over the group (else it is a directory)."""
        with self._lock:
            return int(version) in self._manifests

    def manifest(self, version: int) -> dict:
        with self._lock:
            if int(version) not in self._manifests:
                raise KeyError(f"version {version} was not sent (sent: {sorted(self._manifests)})")
            return self._manifests[int(version)]

    def directory(self, version: int) -> Path:
        """``root/v{version}``; a sent version is written as files first (:attr:`write_files`)."""
        try:
            return self._files.directory(version)
        except KeyError:
            if self.write_files is None or not self.sent(version):
                raise
        self.write_files(int(version))
        return self._files.directory(version)

    def latest_version(self) -> int | None:
        return max(self.versions(), default=None)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(set(self._manifests) | (self._published & set(self._files.versions())))

    def get(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """A version published as files, read (checked); a sent one is not here (``TypeError``)."""
        version = self.latest_version() if version is None else int(version)
        if version is None:
            raise KeyError(f"nothing published or sent under {self.root} yet")
        if self.sent(version):
            raise TypeError(f"SentVersions holds no weights: version {version} is staged in the receivers it went to")
        return self._files.get(version)
