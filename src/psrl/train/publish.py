"""A version's weights written from the ranks as a directory an engine reads (issue #22, item 4).

Layout of ``ROOT/v{N}/`` (written as ``ROOT/v{N}.tmp/`` and renamed into place, so a reader sees all or nothing):

* ``model-0000r-of-0000W.safetensors`` -- rank ``r``'s share: every ``W``-th tensor of the gathered state in name
  order (all ranks gather every tensor -- the all-gathers are collectives -- but each writes only its share);
* ``model.safetensors.index.json`` -- Hugging Face's index (``weight_map``: tensor -> file);
* ``psrl_manifest.json`` -- written last by rank 0 after a barrier: version, dtypes, sha256 of each file.

:func:`read_version` is the reader (checksums verified); :func:`prune` keeps the newest ``keep`` versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["INDEX", "MANIFEST", "shard_file", "write_share", "finish_version", "read_version", "prune", "versions"]

INDEX = "model.safetensors.index.json"
MANIFEST = "psrl_manifest.json"


def shard_file(rank: int, world_size: int) -> str:
    return f"model-{rank + 1:05d}-of-{world_size:05d}.safetensors"


def _share(names: list[str], rank: int, world_size: int) -> list[str]:
    return sorted(names)[rank::world_size]


def write_share(full: dict[str, torch.Tensor], rank: int, world_size: int, tmp: Path) -> Path:
    """Write this rank's share of the gathered ``full`` state into ``tmp`` (which every rank may create)."""
    tmp.mkdir(parents=True, exist_ok=True)
    share = {n: full[n].detach().contiguous() for n in _share(list(full), rank, world_size)}
    path = tmp / shard_file(rank, world_size)
    save_file(share, str(path))
    return path


def finish_version(full: dict[str, torch.Tensor], world_size: int, tmp: Path, version: int, keep: int) -> Path:
    """Rank 0, after every rank's :func:`write_share`: the index, then the manifest, then the atomic rename of
    ``tmp`` to ``v{version}`` (an existing ``v{version}`` -- a version published again after a resume -- is
    replaced), then :func:`prune`."""
    weight_map = {n: shard_file(r, world_size) for r in range(world_size) for n in _share(list(full), r, world_size)}
    total = sum(t.numel() * t.element_size() for t in full.values())
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    files = {f: _sha256(tmp / f) for f in sorted(set(weight_map.values()))}
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in full.values()})
    manifest = {"version": int(version), "dtypes": dtypes, "tensors": len(full), "sha256": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    final = tmp.parent / f"v{version}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(tmp.parent, keep)
    return final


def read_version(directory: str | Path) -> tuple[int, dict[str, torch.Tensor]]:
    """``(version, state)`` of a published directory; a file whose checksum differs from the manifest raises."""
    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    state: dict[str, torch.Tensor] = {}
    for f, digest in manifest["sha256"].items():
        if _sha256(d / f) != digest:
            raise ValueError(f"{d / f}: checksum differs from {MANIFEST}: the version is damaged")
        state.update(load_file(str(d / f)))
    return int(manifest["version"]), state


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
    """Remove all but the newest ``keep`` published versions, and leftover ``.tmp`` directories of older ones."""
    r = Path(root)
    have = versions(r)
    for v in have[: max(len(have) - keep, 0)]:
        shutil.rmtree(r / f"v{v}", ignore_errors=True)
    newest = have[-1] if have else -1
    for p in r.glob("v*.tmp"):
        if p.name[1:-4].isdigit() and int(p.name[1:-4]) < newest:
            shutil.rmtree(p, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
