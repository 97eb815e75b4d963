"""Where versions sent over the collective transport (:mod:`psrl.weights.collective`) are held, by receiver:

* :class:`CollectiveVersions` -- this process receives (the ``hf`` engines of the driver): it holds a version --
  in a file of its own, not in memory -- once every bucket arrived and matched the writer's digests;
* :class:`SentVersions` -- receivers in other processes (vLLM servers' workers, :mod:`psrl.weights.vllm_receiver`)
  staged it: the driver keeps the writer's manifest only, and an engine asks its receiver to load.

A :class:`Receiver` is a member of the transfer group on the receiving side, as the trainer's publisher
(:mod:`psrl.train.transfer`) drives it: ``join``, then per version ``receive`` (the digests it computed), then
``close``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from psrl.lifeline import own_directory
from psrl.weights.collective import (
    BucketLayout,
    GroupAddress,
    TransferFailed,
    TransferGroup,
    check_received,
    receive_version,
    unpack,
)
from psrl.weights.format import with_tied
from psrl.weights.spill import SpillFile
from psrl.weights.store import FileVersions

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
    :class:`psrl.types.WeightSource` and a :class:`~psrl.weights.store.StreamedVersions`): a version is held -- and
    engines can load it -- only once every bucket has arrived and matched the writer's digests. Holds the newest
    ``keep`` versions.

    A version is received into, and held in, a file of ``root`` (:class:`~psrl.weights.spill.SpillFile`), not in
    memory: the process's memory holds the engines' weights and one bucket in flight, whatever ``keep`` is. An
    engine streams a held version bucket by bucket (:meth:`buckets`); :meth:`get` reads it whole (tests, the
    driver's own policy). ``root`` is this process's own (files left there by an earlier run are removed): it needs
    no filesystem shared with the ranks. Without a ``root`` it makes a temporary directory, removed with it.

    One receiver per process: the driver's ``hf`` engines share what it received. ``name`` is what errors call it."""

    def __init__(self, root: str | Path | None = None, keep: int = 2, name: str = "the driver's hf engines"):
        self.name = name
        self.keep = max(int(keep), 1)
        self.root = Path(root) if root is not None else own_directory(self, "psrl-received-")
        self.root.mkdir(parents=True, exist_ok=True)
        for old in list(self.root.glob("v*.recv")) + list(self.root.glob("v*.bin")):
            old.unlink(missing_ok=True)
        self.group: TransferGroup | None = None
        self._lock = threading.Lock()
        self._staged: tuple[int, SpillFile, tuple[BucketLayout, ...], list[str]] | None = None
        self._held: OrderedDict[int, tuple[SpillFile, tuple[BucketLayout, ...], dict[str, str]]] = OrderedDict()

    def join(self, address: GroupAddress, rank: int) -> None:
        """Become group rank ``rank`` (blocks until every member joined)."""
        group = TransferGroup(address, rank)
        with self._lock:
            self.group = group

    def receive(self, version: int, buckets: Sequence[BucketLayout], world: int) -> list[str]:
        """Receive ``version`` from the ``world`` trainer ranks into ``root/v{version}.recv``: its bucket digests;
        the version is staged, not yet held (:meth:`commit` holds it once checked). :class:`TransferFailed` when a
        bucket does not arrive (the file goes)."""
        if self.group is None:
            raise TransferFailed(f"{self.name}: version {version}: not in a transfer group (join first)")
        spill = SpillFile(self.root / f"v{int(version)}.recv", [b.nbytes for b in buckets])
        digests: list[str] = []
        try:
            for _, _, digest in receive_version(self.group, buckets, world, buffer=spill.region):
                digests.append(digest)
        except RuntimeError as exc:  # gloo: a peer gone, a timeout
            spill.discard()
            raise TransferFailed(
                f"{self.name}: version {version} failed after {len(digests)} of {len(buckets)} buckets: {exc}"
            ) from exc
        except BaseException:
            spill.discard()
            raise
        with self._lock:
            old, self._staged = self._staged, (int(version), spill, tuple(buckets), digests)
        if old is not None and old[1].path != spill.path:
            old[1].discard()
        return digests

    def commit(self, version: int, manifest: Mapping) -> None:
        """Hold the staged ``version`` for the engines once its digests match the writer's ``manifest`` (else
        :class:`~psrl.weights.format.VersionDamaged`, and nothing changes); versions beyond ``keep`` go."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None or staged[0] != int(version):
            if staged is not None:
                staged[1].discard()
            raise KeyError(f"{self.name}: version {version} is not staged")
        _, spill, buckets, digests = staged
        latest = self.latest_version()
        try:
            check_received(self.name, version, digests, manifest)
            if latest is not None and int(version) <= latest:
                raise ValueError(f"{self.name}: version {version} <= the newest held, {latest}")
        except BaseException:
            spill.discard()
            raise
        held = spill.rename(self.root / f"v{int(version)}.bin")
        with self._lock:
            self._held[int(version)] = (held, buckets, dict(manifest.get("tied", {})))  # aliases: not sent
            gone = [self._held.popitem(last=False)[1][0] for _ in range(len(self._held) - self.keep)]
        for old in gone:  # an engine reading it keeps its open file: the bytes stay until it is done
            old.discard()

    def close(self) -> None:
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ WeightSource, StreamedVersions

    def latest_version(self) -> int | None:
        with self._lock:
            return next(reversed(self._held)) if self._held else None

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def _version(self, version: int | None) -> tuple[int, SpillFile, tuple[BucketLayout, ...], dict[str, str]]:
        with self._lock:
            if not self._held:
                raise KeyError(f"{self.name}: nothing received yet")
            v = next(reversed(self._held)) if version is None else int(version)
            if v not in self._held:
                raise KeyError(f"{self.name}: version {v} is not held (held: {list(self._held)})")
            return (v, *self._held[v])

    def names(self, version: int) -> list[str]:
        """The tensors of held ``version`` that came (a tied alias did not: :meth:`tied`), in order."""
        _, _, buckets, _ = self._version(version)
        return [n for b in buckets for n in b.names]

    def tied(self, version: int) -> dict[str, str]:
        """``{alias: canonical}`` of held ``version`` (the writer's manifest's ``tied``)."""
        return dict(self._version(version)[3])

    def buckets(self, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """Held ``version``'s tensors, bucket by bucket, as views of a map of that bucket alone: copy what you keep
        before asking for the next (checked on arrival: nothing is checked again). Tied aliases are not in them.
        The version is looked up and its file opened now: dropped later (a newer one arrived), it is still read."""
        _, spill, buckets, _ = self._version(version)  # here, not at the first bucket: the file is open from now
        return (unpack(flat, layout) for flat, layout in zip(spill.regions(), buckets))

    def get(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state)``: a held version read whole into memory (copies; a tied alias the very tensor of its
        canonical name)."""
        v, _, _, tied = self._version(version)
        return v, with_tied({n: t.clone() for part in self.buckets(v) for n, t in part.items()}, tied)


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
