"""The collective transport (issue #33, item 4, ``weights.transport=collective``): the ranks send a version's
buckets over a process group straight to the receiving side, no file in between and no shared filesystem.

**The group.** One per run, apart from the trainer's own (default) process group: each member makes its own
``ProcessGroupGloo`` over a ``TCPStore`` + ``PrefixStore`` (what vLLM's ``stateless_init_torch_distributed_process_
group`` does), so neither the ranks' group nor a vLLM server's is touched. The driver hosts the store
(:func:`host_store`, loopback by default) and is not a member unless it receives. Members: the trainer's ranks
``0 .. W-1`` (in their rank order), then the receivers ``W ..``. Every wait is bounded by
:attr:`GroupAddress.timeout_s` (gloo's timeout on each operation, and ``wait(timeout)`` on each transfer).

**A version.** Its :func:`layout` (per bucket: names, shapes, dtypes, and how many ranks each tensor's rows are
split over -- the same on every rank, from the model's ``state_dict`` and ``weights.bucket_mb``, as :func:`~psrl.weights.publish.iter_buckets` cuts it) reaches the receivers before the
transfer, through the control path (the driver asks rank 0 once, with the model's tied names: a tied tensor is
sent once, and the manifest's ``tied`` lets a receiver put its alias back). Every rank sends its own rows of each
FSDP-sharded tensor straight from its shard, point to point to every receiver -- no gather to an owner, no copy in the shard's
dtype -- and the bucket's owner (rank ``b % W``) any tensor that is not split, gathered (:func:`bucket_parts`;
tensor ``i`` of the version has tag ``i`` from each sender, :func:`first_tags`); each rank computes its part's
digest while the bytes travel (:func:`send_version`). Each receiver receives the parts side by side into one buffer
per bucket, each rank's rows into their place, and rebuilds the tensors as views of it (:func:`receive_version`).
The digest of a bucket is its senders' parts' CRC-32 digests (:func:`~psrl.weights.format.bucket_digest`) joined in
rank order -- one sender: the digest a file of it carries; the receiver computes it again from what arrived and
compares with the manifest rank 0 returns (:func:`check_received`: :class:`~psrl.weights.format.VersionDamaged`
when any bucket or the version digest differs).

**Failure.** A receiver holds what it received apart from anything it serves: a version becomes loadable only
after its last bucket arrived and every digest matched (:class:`CollectiveVersions`). A transfer that fails midway
(a sender gone, a timeout, a damaged bucket) raises :class:`TransferFailed` naming the receiver and the version,
and leaves the engines on the version they had. The cost: the receiver stages the version in flight apart from
the one it serves -- the driver's ``hf`` engines in a file (:mod:`psrl.weights.spill`: one bucket in memory), a
vLLM server's worker in memory (one model's bytes, in the published dtype, in the server's process).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from torch.distributed.tensor import DTensor, Shard

from psrl.weights.format import (
    VersionDamaged,
    bucket_digest,
    crc_digest,
    crc_update,
    plan_buckets,
    untie,
    version_digest,
)
from psrl.weights.publish import MB

__all__ = [
    "GroupAddress",
    "BucketLayout",
    "TransferGroup",
    "TransferFailed",
    "host_store",
    "layout",
    "unpack",
    "row_parts",
    "bucket_parts",
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
    split: tuple[int, ...] = ()
    """Per tensor, how many ranks its rows come from: ``W`` -- an FSDP dim-0 shard on each of the ``W`` ranks,
    each sending its rows straight from its shard (:func:`bucket_parts`); 1 (or none given) -- whole, from the
    bucket's owner."""

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
    at ``bucket_bytes``, with floating tensors cast to ``dtype``, each tied tensor once (under its first name:
    :func:`~psrl.weights.format.untie`): no tensor is gathered or copied."""
    state, _ = untie(model.state_dict())
    cast = {n: dtype if dtype is not None and t.is_floating_point() else t.dtype for n, t in state.items()}
    buckets = plan_buckets([(n, t.numel() * cast[n].itemsize) for n, t in state.items()], bucket_bytes)
    return tuple(
        BucketLayout(
            tuple(names),
            tuple(tuple(state[n].shape) for n in names),
            tuple(str(cast[n]).removeprefix("torch.") for n in names),
            tuple(_split(state[n]) for n in names),
        )
        for names in buckets
    )


def _split(t: torch.Tensor) -> int:
    """The ranks whose shards hold ``t``'s rows: FSDP2's dim-0 ``Shard`` over a 1-D mesh (``torch.chunk`` rows per
    rank); 1 for anything else (a plain tensor, or another placement: gathered whole by its owner)."""
    if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and len(t.placements) == 1:
        place = t.placements[0]
        if isinstance(place, Shard) and place.dim == 0:
            return int(t.device_mesh.size())
    return 1


def row_parts(rows: int, split: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``split`` ranks' rows (``torch.chunk``'s sizes, as FSDP2 shards dim 0)."""
    chunk = -(-rows // split)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(split)]


Part = tuple[int, str, tuple[int, int] | None]
"""One message of a bucket: ``(tensor index in the bucket, name in the digest, rows)`` -- rows None: whole."""


def bucket_parts(bucket: BucketLayout, index: int, world: int) -> dict[int, list[Part]]:
    """Who sends what of bucket ``index``: per sending rank, its messages in tensor order. A split tensor comes as
    each rank's rows (named ``name[lo:hi]`` in that rank's digest; a rank with no rows sends nothing), a whole one
    from the bucket's owner (rank ``index % world``, under its own name). Sender and receiver both derive it from
    the layout, so they agree on every message, tag and digest."""
    out: dict[int, list[Part]] = {}
    for i, (name, shape) in enumerate(zip(bucket.names, bucket.shapes)):
        split = bucket.split[i] if bucket.split else 1
        if split == 1:
            out.setdefault(index % world, []).append((i, name, None))
            continue
        if split != world:
            raise ValueError(f"{name} is split over {split} ranks, the senders are {world}")
        for r, (lo, hi) in enumerate(row_parts(shape[0], split)):
            if hi > lo:
                out.setdefault(r, []).append((i, f"{name}[{lo}:{hi}]", (lo, hi)))
    return dict(sorted(out.items()))


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
) -> list[tuple[int, int, int, str]]:
    """Every rank of the trainer calls it: bucket by bucket, each rank starts sending its part
    (:func:`bucket_parts`) to every receiver (group ranks ``receivers``) -- its own rows of every FSDP-sharded
    tensor straight from its shard (no gather to an owner, no copy unless cast), and the whole tensors of the
    buckets it owns -- and computes its part's digest while the bytes travel. A tensor that is not split is
    gathered whole on every rank (a collective) and sent by its owner. A rank holds one bucket's part beyond its
    shard (cast copies; none in the shard's dtype). Returns ``(bucket, rank, bytes, digest)`` of each part sent."""
    buckets = layout(model, bucket_bytes, dtype)
    tags = first_tags(buckets)
    state = model.state_dict()
    sent: list[tuple[int, int, int, str]] = []
    for b, bucket in enumerate(buckets):
        mine = {i: (name, rows) for i, name, rows in bucket_parts(bucket, b, world).get(rank, [])}
        part: dict[str, torch.Tensor] = {}
        order: list[int] = []
        for i, name in enumerate(bucket.names):
            t = state[name]
            if isinstance(t, DTensor) and (bucket.split[i] if bucket.split else 1) == 1:
                t = t.full_tensor()  # a collective: every rank, in the same order
            if i not in mine:
                continue
            piece, rows = (t.to_local(), mine[i][1]) if isinstance(t, DTensor) else (t, None)
            if rows is not None and piece.shape[0] != rows[1] - rows[0]:
                raise ValueError(f"{name}: rank {rank} holds {piece.shape[0]} rows, not {rows[1] - rows[0]}")
            part[mine[i][0]] = piece.detach().to("cpu", dtype=_dtype(bucket.dtypes[i])).contiguous()
            order.append(i)
        if not part:
            continue
        works = [
            group.isend(t.reshape(-1).view(torch.uint8), dst, tag=tags[b] + i)
            for dst in receivers
            for i, t in zip(order, part.values())
        ]
        sent.append((b, rank, sum(t.numel() * t.element_size() for t in part.values()), bucket_digest(part)))
        for work in works:
            group.wait(work)
        del part, works  # a started send holds its tensor: gone before the next bucket
    return sent


def receive_version(
    group: TransferGroup,
    buckets: Sequence[BucketLayout],
    world: int,
    buffer: Callable[[int], torch.Tensor] | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor], str]]:
    """``(index, tensors, digest)`` per bucket as it arrives from its senders (:func:`bucket_parts`): one buffer per
    bucket, each message received into its place (a rank's rows of a tensor into those rows); the tensors are views
    of it. The digest -- each sender's part's, joined in rank order with ``+`` -- is computed here message by
    message as each arrives, while the later ones are still coming; the next bucket is asked for once this one is
    yielded and its views dropped, so one bucket is in flight at a time. ``buffer(b)``: bucket ``b``'s buffer
    (``uint8``, its ``nbytes``; a region of a :class:`~psrl.weights.spill.SpillFile`, say); default: a new tensor."""
    tags = first_tags(buckets)
    for b, bucket in enumerate(buckets):
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8) if buffer is None else buffer(b)
        views = unpack(flat, bucket)
        del flat
        crcs: dict[int, int] = {}
        arriving: list[tuple[int, str, torch.Tensor, Any]] = []
        for src, parts in bucket_parts(bucket, b, world).items():  # in rank order
            crcs[src] = 0
            for i, name, rows in parts:
                whole = views[bucket.names[i]]
                region = whole if rows is None else whole[rows[0] : rows[1]]
                work = group.irecv(region.reshape(-1).view(torch.uint8), src=src, tag=tags[b] + i)
                arriving.append((src, name, region, work))
        for src, name, region, work in arriving:  # each sender's messages in its order: its part's running CRC
            group.wait(work)
            crcs[src] = crc_update(crcs[src], name, region)
        del arriving
        yield b, views, "+".join(crc_digest(crcs[src]) for src in crcs)
        del views  # this bucket's buffer goes before the next one's comes


def sent_manifest(
    version: int, sent: Sequence[tuple[int, int, int, str]], tied: Mapping[str, str] | None = None
) -> dict:
    """The manifest of a version sent by the ranks (every rank's :func:`send_version` records, gathered): the same
    ``version``, ``digest``, ``bytes`` and per-bucket ``bytes`` and ``digest`` as a published directory's (a
    bucket's digest: its senders' parts' digests in rank order, joined with ``+``; one sender: the digest files
    would carry), and ``tied`` (the model's :func:`~psrl.weights.format.tied_names`, not sent) when any."""
    parts: dict[int, list[tuple[int, int, str]]] = {}
    for b, rank, nbytes, digest in sorted(sent):
        parts.setdefault(b, []).append((rank, nbytes, digest))
    if sorted(parts) != list(range(len(parts))):
        raise ValueError(f"version {version}: buckets {sorted(parts)} are not 0..{len(parts) - 1}")
    digests = ["+".join(d for _, _, d in parts[b]) for b in sorted(parts)]
    sizes = [sum(n for _, n, _ in parts[b]) for b in sorted(parts)]
    return {
        "version": int(version),
        "digest": version_digest(digests),
        "bytes": sum(sizes),
        "buckets": [{"bytes": n, "digest": d} for n, d in zip(sizes, digests)],
        **({"tied": dict(tied)} if tied else {}),
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
