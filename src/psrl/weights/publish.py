"""Publishing a version from the trainer's shards (issue #33, item 3): no process ever holds the whole model.

:func:`iter_buckets` walks the model's tensors in ``state_dict`` order, bucket by bucket (:func:`plan_buckets`):
every rank gathers the bucket's tensors (under FSDP2 each ``full_tensor()`` is a collective, so every rank runs the
same gathers in the same order), casts them to the published dtype, and keeps them only if it owns the bucket
(bucket ``b`` belongs to rank ``b % world``); the others drop them at once. A rank therefore holds at most one
bucket (plus the one tensor being gathered) beyond its shard.

:func:`publish_model` writes the buckets a rank owns into ``ROOT/v{N}.tmp``; rank 0 gathers the others'
:class:`~psrl.weights.format.BucketInfo` and finishes the version (:func:`~psrl.weights.format.finish_version`:
index, manifest, atomic link). :func:`export_state` is world size 1's in-memory twin (the ``hf`` engines of the
driver's own process load from it).

A tied tensor (:func:`~psrl.weights.format.tied_names`) is published once, under its first name; the manifest's
``tied`` names the aliases, and :func:`export_state`'s state has them as the very same tensors. An adapter
version (``select``) publishes exactly the tensors it selects.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from psrl.weights.format import (
    BucketInfo,
    bucket_digest,
    finish_version,
    plan_buckets,
    tied_names,
    untie,
    version_digest,
    with_tied,
    write_bucket,
)

__all__ = ["iter_buckets", "publish_model", "export_state", "state_digest", "MB"]

MB = 1 << 20


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def iter_buckets(
    model: nn.Module,
    rank: int = 0,
    world: int = 1,
    bucket_bytes: int = 256 * MB,
    dtype: torch.dtype | None = None,
    select: Mapping[str, tuple[str, float]] | None = None,
) -> Iterator[tuple[int, int, dict[str, torch.Tensor] | None]]:
    """``(index, count, tensors)`` per bucket, ``tensors`` (CPU, cast to ``dtype`` where floating) on the rank that
    owns the bucket and None on the others. Every rank must run the whole iteration (the gathers are collectives).
    ``select``: publish only these tensors of the state, each as ``(published name, factor)`` (a LoRA adapter's:
    :func:`psrl.weights.adapter.published_names`); None: every tensor as it is named, each tied tensor once
    (:func:`~psrl.weights.format.untie`)."""
    state = model.state_dict()
    if select is not None:
        state = {n: t for n, t in state.items() if n in select}
    else:
        state, _ = untie(state)
    sizes = [(n, t.numel() * _cast(t, dtype).itemsize) for n, t in state.items()]
    buckets = plan_buckets(sizes, bucket_bytes)
    for b, names in enumerate(buckets):
        mine = b % world == rank
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = state[name]
            if isinstance(t, DTensor):  # a collective under FSDP: gathered to the owner alone
                full = _gather_to(t, b % world, mine)
                if full is not None:
                    out[name] = full.detach().to("cpu", dtype=_cast(full, dtype))
                del full
            elif mine:  # a plain module's live parameter: copied
                out[name] = t.detach().to("cpu", dtype=_cast(t, dtype), copy=True)
        if select is not None and mine:
            out = {select[n][0]: (t * select[n][1] if select[n][1] != 1.0 else t) for n, t in out.items()}
        yield b, len(buckets), (out if mine else None)


def _gather_to(t: DTensor, owner: int, mine: bool) -> torch.Tensor | None:
    """The full tensor of ``t`` on rank ``owner`` (None elsewhere). FSDP2's dim-0 shards (``torch.chunk`` sizes) are
    sent to the owner, which receives each straight into its rows of one buffer: the owner holds the tensor once,
    the others nothing more than their shard (``full_tensor()`` all-gathers to every rank, and gloo's collectives
    stage through a second buffer). Any other placement falls back to ``full_tensor()`` (a collective on every
    rank)."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    local = t.to_local()
    world, rows = mesh.size(), t.shape[0]
    chunk = -(-rows // world)
    sizes = [max(0, min(chunk, rows - r * chunk)) for r in range(world)]
    simple = mesh.ndim == 1 and len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0
    if not simple or local.shape[0] != sizes[mesh.get_local_rank()]:
        full = t.full_tensor()
        return full if mine else None
    group = mesh.get_group()
    if not mine:
        if local.shape[0]:
            dist.send(local.contiguous(), dst=dist.get_global_rank(group, owner), group=group)
        return None
    full = torch.empty(tuple(t.shape), dtype=local.dtype, device=local.device)
    for r, size in enumerate(sizes):
        part = full[r * chunk : r * chunk + size]
        if size == 0:
            continue
        if r == owner:
            part.copy_(local)
        else:
            dist.recv(part, src=dist.get_global_rank(group, r), group=group)
    return full


def publish_model(
    model: nn.Module,
    root: str | Path,
    version: int,
    *,
    rank: int = 0,
    world: int = 1,
    bucket_mb: float = 256,
    dtype: torch.dtype | None = None,
    keep: int = 2,
    select: Mapping[str, tuple[str, float]] | None = None,
    meta: Mapping | None = None,
) -> dict:
    """Write ``model`` (sharded over ``world`` ranks, or whole at world 1) as ``root/v{version}``: each rank its own
    buckets, rank 0 the index, manifest and link after gathering the others' bucket records. Every rank calls it;
    on return the version exists. Returns ``{"version", "bytes", "digest", "path"}``. ``select``: as
    :func:`iter_buckets`; ``meta``: more manifest fields (:func:`~psrl.weights.format.finish_version`), and
    ``tied`` when the model has tied tensors."""
    root = Path(root)
    tied = tied_names(model.state_dict()) if select is None else {}
    if tied:
        meta = {**(meta or {}), "tied": tied}
    tmp = root / f"v{int(version)}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed writer's leftovers
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier()
    mine: list[BucketInfo] = []
    for b, count, tensors in iter_buckets(model, rank, world, int(bucket_mb * MB), dtype, select):
        if tensors is not None:
            mine.append(write_bucket(tmp, b, count, tensors))
            del tensors
    infos = mine
    if world > 1:
        gathered: list[list[BucketInfo]] | None = [[] for _ in range(world)] if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        infos = [i for part in gathered or [] for i in part]
    summary: list[dict] = [{}]
    if rank == 0:
        final = finish_version(tmp, root, version, infos, keep, meta)
        digest = version_digest([i.digest for i in sorted(infos, key=lambda i: i.index)])
        summary = [
            {"version": int(version), "bytes": sum(i.nbytes for i in infos), "digest": digest, "path": str(final)}
        ]
    if world > 1:
        dist.broadcast_object_list(summary, src=0)  # also the barrier: the version exists on every rank's return
    return summary[0]


def export_state(
    model: nn.Module,
    bucket_mb: float = 256,
    dtype: torch.dtype | None = None,
    select: Mapping[str, tuple[str, float]] | None = None,
) -> dict[str, torch.Tensor]:
    """World size 1 in memory: the model's tensors (CPU copies, in ``dtype``; ``select`` as :func:`iter_buckets`),
    bucket by bucket as :func:`publish_model` takes them, each tied tensor copied once (its aliases: the same
    tensor). No digest: nothing crosses a process (:func:`state_digest` computes the one :func:`publish_model`
    would write, when a caller wants it)."""
    state: dict[str, torch.Tensor] = {}
    for _, _, tensors in iter_buckets(model, 0, 1, int(bucket_mb * MB), dtype, select):
        assert tensors is not None
        state.update(tensors)
    return with_tied(state, tied_names(model.state_dict()) if select is None else {})


def state_digest(state: Mapping[str, torch.Tensor], bucket_mb: float = 256) -> str:
    """The version digest :func:`publish_model` writes for these tensors, in this order, at ``bucket_mb`` (each tied
    tensor once, as published)."""
    state, _ = untie(state)
    sizes = [(n, t.numel() * t.element_size()) for n, t in state.items()]
    buckets = plan_buckets(sizes, int(bucket_mb * MB))
    return version_digest([bucket_digest({n: state[n] for n in names}) for names in buckets])
