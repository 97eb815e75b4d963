"""The collective transport (issue #33, item 4, ``weights.transport=collective``): the ranks send a version's
buckets over a process group straight to the receiving side, no file in between and no shared filesystem.

**The group.** One per run, apart from the trainer's own (default) process group: each member makes its own
``ProcessGroupGloo`` over a ``TCPStore`` + ``PrefixStore`` (what vLLM's ``stateless_init_torch_distributed_process_
group`` does), so neither the ranks' group nor a vLLM server's is touched. The driver hosts the store
(:func:`host_store`, loopback by default) and is not a member unless it receives. Members: the trainer's ranks
``0 .. W-1`` (in their rank order), then the receivers ``W ..``. Every wait is bounded by
:attr:`GroupAddress.timeout_s` (gloo's timeout on each operation, and ``wait(timeout)`` on each transfer).

**A version.** Its :func:`layout` (per bucket: names, shapes, dtypes -- the same on every rank, from the model's
``state_dict`` and ``weights.bucket_mb``, as :func:`~psrl.weights.publish.iter_buckets` cuts it) reaches the
receivers before the transfer, through the control path (the driver asks rank 0 once). Bucket ``b``'s owner
(rank ``b % W``) sends its tensors point to point to every receiver, each as the bytes of the tensor itself (no
copy; tensor ``i`` of the version has tag ``i``, :func:`first_tags`), and computes the bucket's digest while they
travel (:func:`send_version`); each receiver receives them side by side into one buffer per bucket and rebuilds the
tensors as views of it (:func:`receive_version`). The writer computes each bucket's digest (:func:`~psrl.weights.format.bucket_digest`,
as for files); the receiver computes it again from what arrived and compares with the manifest rank 0 returns
(:func:`check_received`: :class:`~psrl.weights.format.VersionDamaged` when any bucket or the version digest
differs).

**Failure.** A receiver holds what it received apart from anything it serves: a version becomes loadable only
after its last bucket arrived and every digest matched (:class:`CollectiveVersions`). A transfer that fails midway
(a sender gone, a timeout, a damaged bucket) raises :class:`TransferFailed` naming the receiver and the version,
and leaves the engines on the version they had. The cost: the receiving process holds the version in flight
beside the versions it keeps (one model's bytes, in the published dtype, during the transfer).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from psrl.weights.format import VersionDamaged, bucket_digest, plan_buckets, version_digest
from psrl.weights.publish import MB, iter_buckets

__all__ = [
    "GroupAddress",
    "BucketLayout",
    "TransferGroup",
    "TransferFailed",
    "host_store",
    "layout",
    "unpack",
    "first_tags",
    "send_bucket",
    "send_version",
    "receive_version",
    "sent_manifest",
    "check_received",
]


class TransferFailed(RuntimeError):
    """A collective transfer that did not complete: the receiver keeps the versions it had."""


@dataclass(frozen=True)
class GroupAddress:
    """Where a run's transfer group meets (plain data: it crosses to the ranks and to engine servers)."""

    host: str
    port: int
    size: int
    """Members: the trainer's ranks, then the receivers."""
    name: str
    """The store prefix of this group (one per run and per rebuild)."""
    timeout_s: float = 300.0
    """The bound on every wait: joining, each send and each receive."""


@dataclass(frozen=True)
class BucketLayout:
    """One bucket as a receiver needs it before its bytes arrive: tensors in order, their shapes and dtypes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * _dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def host_store(host: str = "127.0.0.1", timeout_s: float = 300.0) -> tuple[TCPStore, int]:
    """The rendezvous store of a transfer group, served from this process on a free port of ``host``: ``(store,
    port)``. Keep the store for as long as the group lives."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    store = TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, port


class TransferGroup:
    """This process's membership of a transfer group (module docstring): point-to-point sends and receives of flat
    byte buffers, each bounded by the address's ``timeout_s``. Joining blocks until every member has joined."""

    def __init__(self, address: GroupAddress, rank: int):
        if not 0 <= rank < address.size:
            raise ValueError(f"transfer group rank {rank} is outside 0..{address.size - 1}")
        self.address, self.rank = address, rank
        self.timeout = timedelta(seconds=address.timeout_s)
        client = TCPStore(address.host, address.port, is_master=False, timeout=self.timeout)
        self._store = client  # kept: the group's connections were made through it
        self.pg: Any = ProcessGroupGloo(PrefixStore(address.name, client), rank, address.size, self.timeout)

    def _pg(self) -> Any:
        """The gloo group (``Any``: its ``send``/``recv`` are not in torch's stubs); :class:`TransferFailed` once
        closed."""
        if self.pg is None:
            raise TransferFailed(f"transfer group rank {self.rank} has left {self.address.name}")
        return self.pg

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self.wait(self.isend(buf, dst, tag))

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        self.wait(self.irecv(buf, src, tag))

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``buf`` (keep it alive until :meth:`wait`)."""
        return self._pg().send([buf], dst, tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into ``buf``; :meth:`wait` for it."""
        return self._pg().recv([buf], src, tag)

    def wait(self, work: Any) -> None:
        """Wait for a started send or receive, at most the group's timeout."""
        work.wait(self.timeout)

    def close(self) -> None:
        """Leave the group: peers still waiting on this member fail at once rather than at their timeout (gloo
        closes its connections when the group object goes, not on ``shutdown`` alone). Idempotent."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.shutdown()


def layout(
    model: nn.Module, bucket_bytes: int = 256 * MB, dtype: torch.dtype | None = None
) -> tuple[BucketLayout, ...]:
    """The buckets :func:`~psrl.weights.publish.iter_buckets` makes of ``model`` (its full shapes, under FSDP too)
    at ``bucket_bytes``, with floating tensors cast to ``dtype``: no tensor is gathered or copied."""
    state = model.state_dict()
    cast = {n: dtype if dtype is not None and t.is_floating_point() else t.dtype for n, t in state.items()}
    buckets = plan_buckets([(n, t.numel() * cast[n].itemsize) for n, t in state.items()], bucket_bytes)
    return tuple(
        BucketLayout(
            tuple(names),
            tuple(tuple(state[n].shape) for n in names),
            tuple(str(cast[n]).removeprefix("torch.") for n in names),
        )
        for names in buckets
    )


def unpack(flat: torch.Tensor, bucket: BucketLayout) -> dict[str, torch.Tensor]:
    """The bucket's tensors as views of ``flat`` (no copy), in the layout's order."""
    if flat.numel() != bucket.nbytes:
        raise ValueError(f"a buffer of {flat.numel()} bytes for a bucket of {bucket.nbytes}")
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, shape, dtype in zip(bucket.names, bucket.shapes, bucket.dtypes):
        dt = _dtype(dtype)
        n = _numel(shape) * dt.itemsize
        out[name] = flat[at : at + n].view(dt).reshape(shape)
        at += n
    return out


def first_tags(buckets: Sequence[BucketLayout]) -> list[int]:
    """The message tag of each bucket's first tensor: tensor ``i`` of the version (in order) is sent with tag
    ``i``, so every message of a version between two members has its own tag."""
    out, n = [], 0
    for b in buckets:
        out.append(n)
        n += len(b.names)
    return out


def send_bucket(group: TransferGroup, tensors: Mapping[str, torch.Tensor], dst: int, first_tag: int) -> list[Any]:
    """Start sending a bucket's tensors, in order, each as the bytes of the tensor itself (no copy: the receiver
    puts them side by side in one buffer); the started sends (keep ``tensors`` alive until they are waited)."""
    return [
        group.isend(t.contiguous().reshape(-1).view(torch.uint8), dst, tag=first_tag + i)
        for i, t in enumerate(tensors.values())
    ]


def send_version(
    group: TransferGroup,
    model: nn.Module,
    *,
    rank: int,
    world: int,
    receivers: Sequence[int],
    bucket_bytes: int = 256 * MB,
    dtype: torch.dtype | None = None,
) -> list[tuple[int, int, str]]:
    """Every rank of the trainer calls it (the gathers are collectives): the owner of each bucket starts sending its
    tensors to every receiver (group ranks ``receivers``) and computes the bucket's digest while the bytes travel.
    A rank holds one bucket beyond its shard: nothing is packed or copied to send. Returns ``(index, bytes,
    digest)`` of the buckets this rank sent."""
    tags = first_tags(layout(model, bucket_bytes, dtype))
    sent: list[tuple[int, int, str]] = []
    for b, _, tensors in iter_buckets(model, rank, world, bucket_bytes, dtype):
        if tensors is None:
            continue
        works = [w for dst in receivers for w in send_bucket(group, tensors, dst, tags[b])]
        sent.append((b, sum(t.numel() * t.element_size() for t in tensors.values()), bucket_digest(tensors)))
        for work in works:
            group.wait(work)
        del tensors, works  # a started send holds its tensor: gone before the next bucket is gathered
    return sent


def receive_version(
    group: TransferGroup, buckets: Sequence[BucketLayout], world: int
) -> Iterator[tuple[int, dict[str, torch.Tensor], str]]:
    """``(index, tensors, digest)`` per bucket as it arrives from its owner (group rank ``b % world``): one buffer
    per bucket, each tensor's bytes received into its place; the tensors are views of it, the digest computed here
    from them -- while the next bucket is already arriving (at most two buckets in flight)."""
    tags = first_tags(buckets)

    def post(b: int) -> tuple[torch.Tensor, list[Any]]:
        flat = torch.empty(buckets[b].nbytes, dtype=torch.uint8)
        views = unpack(flat, buckets[b])
        works = [
            group.irecv(t.reshape(-1).view(torch.uint8), src=b % world, tag=tags[b] + i)
            for i, t in enumerate(views.values())
        ]
        return flat, works

    nxt = post(0) if buckets else None
    for b, bucket in enumerate(buckets):
        assert nxt is not None
        flat, works = nxt
        for work in works:
            group.wait(work)
        nxt = post(b + 1) if b + 1 < len(buckets) else None
        tensors = unpack(flat, bucket)
        yield b, tensors, bucket_digest(tensors)


def sent_manifest(version: int, sent: Sequence[tuple[int, int, str]]) -> dict:
    """The manifest of a version sent by the ranks (every rank's :func:`send_version` records, gathered): the same
    ``version``, ``digest``, ``bytes`` and per-bucket ``bytes`` and ``digest`` as a published directory's."""
    ordered = sorted(sent)
    if [b for b, _, _ in ordered] != list(range(len(ordered))):
        raise ValueError(f"version {version}: buckets {[b for b, _, _ in ordered]} are not 0..{len(ordered) - 1}")
    return {
        "version": int(version),
        "digest": version_digest([d for _, _, d in ordered]),
        "bytes": sum(n for _, n, _ in ordered),
        "buckets": [{"bytes": n, "digest": d} for _, n, d in ordered],
    }


def check_received(who: str, version: int, digests: Sequence[str], manifest: Mapping) -> None:
    """Compare the digests a receiver computed with the writer's ``manifest`` (``{"digest", "buckets": [{"digest"}
    ...]}``); :class:`VersionDamaged` naming ``who``, the version and the first bucket that differs."""
    theirs = [b["digest"] for b in manifest["buckets"]]
    if len(theirs) != len(digests):
        raise VersionDamaged(f"{who}: version {version} came as {len(digests)} buckets, the writer sent {len(theirs)}")
    for b, (mine, sent) in enumerate(zip(digests, theirs)):
        if mine != sent:
            raise VersionDamaged(f"{who}: bucket {b} of version {version} differs from what its writer sent")
    if version_digest(list(digests)) != manifest["digest"]:
        raise VersionDamaged(f"{who}: version {version}'s digest differs from its writer's")
