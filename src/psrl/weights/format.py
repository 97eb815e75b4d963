"""The format of one published version (issue #33, item 2): the one owner of what ``ROOT/v{N}`` holds.

A version is the model's tensors in a fixed order (the model's ``state_dict`` order, the same on every rank and at
every world size), cut into **buckets** of at most ``weights.bucket_mb`` (:func:`plan_buckets`; a tensor larger than
that is a bucket of its own). On disk, ``ROOT/v{N}`` is a symbolic link to the directory that holds:

* ``model-0000b-of-0000n.safetensors`` -- bucket ``b`` (Hugging Face's sharded layout: vLLM and ``transformers``
  read it as it is);
* ``model.safetensors.index.json`` -- Hugging Face's index (``weight_map``: tensor -> file);
* ``psrl_manifest.json`` -- written last: version, the version's digest, and per bucket its file, tensors, bytes
  and digest; ``tied`` (``{alias: canonical}``) when the model has tied tensors.

**Tied tensors** (a tied embedding and head: one parameter under two names, both in ``state_dict``) are published
once: :func:`tied_names` says which names are aliases of an earlier one, every writer and sender skips them
(:func:`untie`), and every reader that builds a whole state puts each back as the very same tensor as its canonical
name (:func:`with_tied`). Hugging Face's ``from_pretrained`` and vLLM tie such a model's head themselves.

The digest of a bucket is a CRC-32 (``zlib.crc32``, ``crc32:xxxxxxxx``) over its tensors' names, dtypes, shapes
and bytes (:func:`bucket_digest`): it catches a damaged or half-copied file and a transfer that went wrong, at
~3x the speed of sha256 (``benchmarks/weights_scale.py``'s ``floors``: it is computed on both sides of every
sync); versions written before it carry sha256 digests and are still checked with sha256. The version's digest is
sha256 over its buckets' digests in order (:func:`version_digest`). It is computed once, by the writer,
from the tensors it writes; every reader -- a file reader here, a transport receiving the buckets -- recomputes it
from what it received and compares. The link makes a version appear atomically, and a re-publish of the same
version (after a resume) replace it atomically (:func:`finish_version`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

__all__ = [
    "INDEX",
    "MANIFEST",
    "BucketInfo",
    "bucket_file",
    "plan_buckets",
    "tied_names",
    "untie",
    "with_tied",
    "state_bytes",
    "bucket_digest",
    "crc_update",
    "crc_digest",
    "version_digest",
    "write_bucket",
    "finish_version",
    "read_manifest",
    "read_buckets",
    "read_version",
    "check_version",
    "versions",
    "prune",
    "VersionDamaged",
]

INDEX = "model.safetensors.index.json"
MANIFEST = "psrl_manifest.json"
CRC = "crc32:"
"""The prefix of a CRC-32 bucket digest (:func:`bucket_digest`)."""


class VersionDamaged(ValueError):
    """A published version whose contents differ from its manifest (a damaged or half-copied directory)."""


@dataclass(frozen=True)
class BucketInfo:
    """One written bucket, as its writer reports it (plain data: it crosses processes)."""

    index: int
    file: str
    names: tuple[str, ...]
    nbytes: int
    digest: str
    dtypes: tuple[str, ...]


def bucket_file(index: int, count: int) -> str:
    """The file of bucket ``index`` (0-based) of ``count``: Hugging Face's shard name."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """``(name, bytes)`` in publication order -> buckets of names, in order, each at most ``bucket_bytes`` (a
    tensor larger than that alone). Depends only on the names and sizes: every rank and world size agrees."""
    out: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not out or (used + nbytes > bucket_bytes and out[-1]):
            out.append([])
            used = 0
        out[-1].append(name)
        used += nbytes
    return out


def tied_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: canonical}`` of a state (a ``state_dict``, in its order): a tensor that is the same tensor as an
    earlier name's, or views the same memory the same way (storage, offset, shape, strides, dtype: ``state_dict``
    detaches every tensor, so a tied parameter comes as two tensor objects), is an alias of that earlier name.
    Under FSDP2 the two names are two ``DTensor`` objects over one local shard: compared by that shard and the
    global shape and placements, so every rank finds the same aliases (an empty local shard included: the storage
    itself is compared, not its address). A tensor with no elements is never an alias."""
    seen: dict[object, str] = {}
    out: dict[str, str] = {}
    for name, t in state.items():
        if t.numel() == 0:
            continue
        keys = (("id", id(t)), _memory(t))
        canonical = next((seen[k] for k in keys if k in seen), None)
        if canonical is not None:
            out[name] = canonical
            continue
        for k in keys:
            seen[k] = name
    return out


def _memory(t: torch.Tensor) -> tuple:
    """What identifies the memory a tensor views, and how (its local shard's, for a ``DTensor``)."""
    local, whole = (
        (t.to_local(), (tuple(t.shape), tuple(map(str, t.placements)))) if isinstance(t, DTensor) else (t, ())
    )
    storage = local.untyped_storage()._cdata  # the storage itself (two tensors over one storage share it)
    return ("memory", storage, local.storage_offset(), tuple(local.shape), local.stride(), local.dtype, whole)


def untie(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state without its aliases, {alias: canonical})`` (:func:`tied_names`): what a version publishes."""
    tied = tied_names(state)
    return {n: t for n, t in state.items() if n not in tied}, tied


def with_tied(state: dict[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each alias of ``tied`` put back as the very tensor of its canonical name (no copy: loading it
    into a model whose names are tied writes one parameter); ``state`` itself, updated."""
    for alias, canonical in tied.items():
        if canonical not in state:
            raise VersionDamaged(f"{alias} is tied to {canonical}, which the version does not hold")
        state[alias] = state[canonical]
    return state


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes of a state's tensors, each tied tensor once (``weights/bytes`` of a version held in memory)."""
    tied = tied_names(state)
    return sum(t.numel() * t.element_size() for n, t in state.items() if n not in tied)


def bucket_digest(tensors: Mapping[str, torch.Tensor], like: str | None = None) -> str:
    """CRC-32 over the tensors in their given order: name, dtype, shape, then the raw bytes (``crc32:`` and 8 hex
    digits). ``like``: the digest to compare with -- one without the ``crc32:`` prefix is sha256 over the same
    (versions written before the CRC), and is recomputed so."""
    if like is not None and not like.startswith(CRC):
        h = hashlib.sha256()
        for name, t in tensors.items():
            h.update(_header(name, t))
            h.update(_bytes(t))
        return h.hexdigest()
    crc = 0
    for name, t in tensors.items():
        crc = crc_update(crc, name, t)
    return crc_digest(crc)


def crc_update(crc: int, name: str, t: torch.Tensor) -> int:
    """The running CRC-32 of a bucket's tensors (start at 0) after ``name`` and ``t``: a reader that gets the
    tensors one at a time computes :func:`bucket_digest` as they come (:func:`crc_digest` at the end)."""
    return zlib.crc32(_bytes(t), zlib.crc32(_header(name, t), crc))


def crc_digest(crc: int) -> str:
    """The digest :func:`bucket_digest` writes for a running CRC-32 (:func:`crc_update`)."""
    return f"{CRC}{crc:08x}"


def _header(name: str, t: torch.Tensor) -> bytes:
    return f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode()


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a view (no copy of a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def version_digest(bucket_digests: Sequence[str]) -> str:
    """The digest of a version: sha256 over its buckets' digests, in bucket order."""
    return hashlib.sha256("".join(bucket_digests).encode()).hexdigest()


def write_bucket(directory: Path, index: int, count: int, tensors: Mapping[str, torch.Tensor]) -> BucketInfo:
    """Write bucket ``index`` of ``count`` into ``directory`` (created if needed); returns what the manifest says
    of it. The digest is computed here, from the tensors written."""
    directory.mkdir(parents=True, exist_ok=True)
    name = bucket_file(index, count)
    body = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(body, str(directory / name))
    return BucketInfo(
        index,
        name,
        tuple(body),
        sum(t.numel() * t.element_size() for t in body.values()),
        bucket_digest(body),
        tuple(sorted({str(t.dtype).removeprefix("torch.") for t in body.values()})),
    )


def finish_version(
    tmp: Path, root: Path, version: int, buckets: Sequence[BucketInfo], keep: int, meta: Mapping | None = None
) -> Path:
    """After every bucket of ``tmp`` is written: the index, then the manifest, then ``root/v{version}`` -- a link
    to ``tmp`` renamed to a unique name -- made or replaced in one ``os.replace`` (a reader sees the old version or
    the new one, whole); then :func:`prune` to ``keep`` versions. Returns ``root/v{version}``. ``meta``: more
    manifest fields (an adapter version's ``kind``, base and LoRA settings: :mod:`psrl.weights.adapter`)."""
    buckets = sorted(buckets, key=lambda b: b.index)
    if [b.index for b in buckets] != list(range(len(buckets))):
        raise ValueError(f"version {version}: buckets {[b.index for b in buckets]} are not 0..{len(buckets) - 1}")
    weight_map = {n: b.file for b in buckets for n in b.names}
    total = sum(b.nbytes for b in buckets)
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    manifest = {
        "version": int(version),
        "digest": version_digest([b.digest for b in buckets]),
        "bytes": total,
        "tensors": len(weight_map),
        "dtypes": sorted({d for b in buckets for d in b.dtypes}),
        "buckets": [{"file": b.file, "names": list(b.names), "bytes": b.nbytes, "digest": b.digest} for b in buckets],
        **(meta or {}),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    data = root / f"v{int(version)}.{uuid.uuid4().hex[:8]}"
    os.replace(tmp, data)
    link = root / f".v{int(version)}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(data.name, link)
    final = root / f"v{int(version)}"
    if final.is_dir() and not final.is_symlink():  # a version of the earlier layout (a real directory)
        shutil.rmtree(final)
    os.replace(link, final)
    prune(root, keep)
    return final


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a published version (raises ``FileNotFoundError`` when it is not complete)."""
    return json.loads((Path(directory) / MANIFEST).read_text())


def read_buckets(directory: str | Path, check: bool = True) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``(index, tensors)`` per bucket, in order, each checked against the manifest's digest
    (:class:`VersionDamaged` when it differs; ``check=False``: a second pass over a version checked already): a
    reader that loads bucket by bucket holds one at a time."""
    d = Path(directory)
    manifest = read_manifest(d)
    for i, b in enumerate(manifest["buckets"]):
        loaded = load_file(str(d / b["file"]))
        tensors = {n: loaded[n] for n in b["names"]}
        if check and bucket_digest(tensors, like=b["digest"]) != b["digest"]:
            raise VersionDamaged(f"{d / b['file']}: its tensors differ from {MANIFEST}: the version is damaged")
        yield i, tensors


def check_version(directory: str | Path) -> int:
    """Read every bucket of a published version and check it against the manifest, holding one bucket at a time
    (:class:`VersionDamaged` if any differs); returns the version. A loader that then streams the buckets into a
    live model cannot be left half-updated by a damaged file."""
    manifest = read_manifest(directory)
    if version_digest([b["digest"] for b in manifest["buckets"]]) != manifest["digest"]:
        raise VersionDamaged(f"{directory}: the buckets' digests do not make the manifest's version digest")
    for _ in read_buckets(directory):
        pass
    return int(manifest["version"])


def read_version(directory: str | Path) -> tuple[int, dict[str, torch.Tensor]]:
    """``(version, state)`` of a published directory, every bucket checked (:func:`read_buckets`), tied names put
    back (:func:`with_tied`)."""
    manifest = read_manifest(directory)
    if version_digest([b["digest"] for b in manifest["buckets"]]) != manifest["digest"]:
        raise VersionDamaged(f"{directory}: the buckets' digests do not make the manifest's version digest")
    state: dict[str, torch.Tensor] = {}
    for _, tensors in read_buckets(directory):
        state.update(tensors)
    return int(manifest["version"]), with_tied(state, manifest.get("tied", {}))


def versions(root: str | Path) -> list[int]:
    """Published versions under ``root`` (complete ones: ``v{N}`` with a manifest), oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = [
        int(p.name[1:]) for p in r.iterdir() if p.name[1:].isdigit() and p.name[0] == "v" and (p / MANIFEST).exists()
    ]
    return sorted(out)


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` published versions: older links and their directories go, and so do directories
    no link names (a re-published version's old data, a writer's leftovers) that are not the newest's."""
    r = Path(root)
    have = versions(r)
    for v in have[: max(len(have) - max(keep, 1), 0)]:
        link = r / f"v{v}"
        target = link.resolve() if link.is_symlink() else None
        link.unlink() if link.is_symlink() else shutil.rmtree(link, ignore_errors=True)
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)
    named = {(r / f"v{v}").resolve().name for v in versions(r) if (r / f"v{v}").is_symlink()}
    newest = have[-1] if have else -1
    for p in r.glob("v*.*"):
        head = p.name[1:].split(".", 1)[0]
        if head.isdigit() and p.name not in named and int(head) < newest and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
