"""Weights to Ray engine actors through Ray's object store (issue #37, item 2): no shared filesystem between the
trainer's nodes and the rollout nodes.

The ranks publish ``RUN_DIR/weights/v{N}`` as always (:mod:`psrl.weights`: on the trainer's nodes; what
validation, ``final/`` and a resume read). Then each rank puts the buckets it owns (bucket ``b`` is rank ``b % W``'s,
the one that wrote it) into the object store of its own node (:func:`put_owned`: the file it has just written, read
back on its node) and keeps their refs for the newest ``keep`` versions. The driver's :class:`ObjectVersions`
holds only those refs -- never a bucket's bytes -- and an engine actor gets them, nested in a list so that Ray
does not resolve them in the call, fetches the buckets one at a time from the ranks' nodes and checks each against
its writer's digest (:func:`receive`) before loading anything. No engine actor opens a file of ``run_dir``.

At world size 1 the trainer's one rank is the driver itself, which then puts the buckets it wrote.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from psrl.weights import VersionDamaged, VersionDirectories, bucket_digest, read_manifest, version_digest
from psrl.weights.format import finish_version, write_bucket

__all__ = ["ObjectVersions", "put_owned", "receive", "write_local", "Bucket"]

Bucket = tuple[int, str, Any]
"""``(index, writer's digest, ref)`` of one bucket in the object store."""


def put_owned(directory: str | Path, rank: int = 0, world: int = 1) -> tuple[int, str, list[Bucket]]:
    """``ray.put`` the buckets of the published version ``directory`` that ``rank`` of ``world`` owns (``b % world
    == rank``); returns the version, its digest and the buckets' refs (owned by this process: they live while it
    does and a holder of the refs remains)."""
    from safetensors.torch import load_file

    import ray

    d = Path(directory)
    manifest = read_manifest(d)
    out: list[Bucket] = []
    for i, b in enumerate(manifest["buckets"]):
        if i % world == rank:
            loaded = load_file(str(d / b["file"]))
            out.append((i, b["digest"], ray.put({n: loaded[n] for n in b["names"]})))
            del loaded
    return int(manifest["version"]), str(manifest["digest"]), out


async def receive(digest: str, buckets: list[Bucket]) -> list[dict[str, torch.Tensor]]:
    """The buckets of one version, in order, from their refs, fetched one at a time, each checked against its
    writer's digest, and the list against the version's (:class:`~psrl.weights.VersionDamaged` on any
    difference)."""
    ordered = sorted(buckets, key=lambda b: b[0])
    if [b[0] for b in ordered] != list(range(len(ordered))):
        raise VersionDamaged(f"buckets {[b[0] for b in ordered]} are not 0..{len(ordered) - 1}")
    if version_digest([b[1] for b in ordered]) != digest:
        raise VersionDamaged("the buckets' digests do not make the version's digest")
    out: list[dict[str, torch.Tensor]] = []
    for index, want, ref in ordered:
        tensors = await ref
        if bucket_digest(tensors) != want:
            raise VersionDamaged(f"bucket {index} arrived different from what its writer put")
        out.append(tensors)
    return out


def write_local(
    root: Path, version: int, buckets: list[dict[str, torch.Tensor]], keep: int = 2, tied: dict | None = None
) -> Path:
    """The received ``buckets`` as the published version ``root/v{version}`` on this node (Hugging Face's sharded
    layout, what a vLLM server's ``reload_weights`` reads): a directory of the engine's own, not ``run_dir``.
    ``tied``: the model's tied names (:func:`~psrl.weights.format.tied_names`; the buckets hold each tied tensor
    once), recorded in the manifest."""
    tmp = root / f"v{int(version)}.tmp"
    infos = [write_bucket(tmp, i, len(buckets), tensors) for i, tensors in enumerate(buckets)]
    return finish_version(tmp, root, int(version), infos, keep, {"tied": tied} if tied else None)


class ObjectVersions:
    """The driver's refs of the published versions' buckets, by version (the newest ``keep``): recorded from the
    ranks' publish replies (:meth:`record`); a version nobody recorded (world size 1: the driver wrote it) is put
    here from its directory on first use. Thread-safe: the ranks reply on the training thread, engines ask on the
    event loop."""

    def __init__(self, keep: int = 2):
        self.keep = max(int(keep), 1)
        self._lock = threading.Lock()
        self._versions: dict[int, tuple[str, list[Bucket]]] = {}

    def record(self, version: int, digest: str, buckets: list[Bucket]) -> None:
        """The refs of ``version`` (every rank's buckets), replacing an older record of it (a re-publish)."""
        with self._lock:
            self._versions[int(version)] = (digest, sorted(buckets, key=lambda b: b[0]))
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]

    def buckets(self, version: int, store: VersionDirectories) -> tuple[str, list[Bucket]]:
        """``(digest, buckets)`` of ``version``; put from ``store``'s directory by this process when no rank
        recorded it (a version ``store`` has not published is its ``KeyError``)."""
        with self._lock:
            got = self._versions.get(int(version))
        if got is not None:
            return got
        v, digest, buckets = put_owned(store.directory(int(version)))
        self.record(v, digest, buckets)
        return digest, buckets
