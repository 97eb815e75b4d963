"""A published version as a Hugging Face model directory (issue #33, item 5): what ``final/`` is and what a vLLM
server starts from, made from the version's files -- no process loads the weights to write it.

``v{N}`` already holds Hugging Face's sharded layout (``model-0000b-of-0000n.safetensors`` and
``model.safetensors.index.json``, :mod:`~psrl.weights.format`); :func:`write_model_directory` adds the model's
``config.json`` and the tokenizer beside them, and ``psrl_version.txt``. The safetensors are hard links to the
version's files where the filesystem allows (no bytes copied; pruning the version later leaves them), copies
otherwise. The directory appears whole (written beside it, then renamed).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from psrl.weights.format import INDEX, bucket_file, read_manifest
from psrl.weights.store import StreamedVersions

__all__ = [
    "write_model_directory",
    "write_streamed_directory",
    "VERSION_FILE",
    "untied_directory",
    "TIED_FILE",
    "UNTIED_DIR",
]

TIED_FILE = "model-tied.safetensors"
"""In :func:`untied_directory`: each tied alias of the version, as a tensor of its own."""
UNTIED_DIR = "untied"
"""The subdirectory of a version with a tied alias that :func:`untied_directory` makes for vLLM."""

VERSION_FILE = "psrl_version.txt"
"""The version a model directory holds (``final/``), one line."""


def write_model_directory(version_dir: str | Path, out: str | Path, model: Any, tokenizer: Any) -> Path:
    """``out``: the published version ``version_dir`` as a directory ``AutoModelForCausalLM.from_pretrained`` (and
    ``model.path``, and a vLLM server) loads. ``model``: the ``transformers`` model (e.g. a weightless policy's, on
    ``meta``), or its config: the config is written with the model's class as ``architectures`` where it names
    none (a config built in code, never saved, has none, and vLLM picks its model class by it); ``tokenizer``:
    anything with ``save_pretrained(directory)``. Replaces ``out`` if it exists."""
    src = Path(version_dir).resolve()
    manifest = read_manifest(src)  # a complete version only

    def weights(tmp: Path) -> None:
        for name in [b["file"] for b in manifest["buckets"]] + [INDEX]:
            _link_or_copy(src / name, tmp / name)

    return _model_directory(out, weights, int(manifest["version"]), model, tokenizer)


def write_streamed_directory(
    store: StreamedVersions, version: int, out: str | Path, model: Any, tokenizer: Any
) -> Path:
    """``out``: held ``version`` of a source that streams its buckets (the driver's collective receiver, whose
    versions are not directories) as a Hugging Face directory, as :func:`write_model_directory` makes one: the
    buckets written as safetensors shards one at a time (one bucket in memory), the index (tied aliases are left
    to ``from_pretrained``, as in a published version), the config, the tokenizer, ``psrl_version.txt``."""

    def weights(tmp: Path) -> None:
        written: list[list[str]] = []
        for i, tensors in enumerate(store.buckets(int(version))):
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / f"part-{i}"))
            written.append(list(tensors))
            del tensors
        weight_map = {}
        for i, names in enumerate(written):
            name = bucket_file(i, len(written))
            os.replace(tmp / f"part-{i}", tmp / name)
            weight_map.update(dict.fromkeys(names, name))
        (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))

    return _model_directory(out, weights, int(version), model, tokenizer)


def _model_directory(
    out: str | Path, weights: Callable[[Path], None], version: int, model: Any, tokenizer: Any
) -> Path:
    """``out`` written beside itself and renamed (it appears whole): ``weights(tmp)`` puts the safetensors and the
    index, then the config (with ``architectures``, :func:`write_model_directory`), the tokenizer and
    ``psrl_version.txt``."""
    config = getattr(model, "config", model)
    if config is not model and not getattr(config, "architectures", None):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        weights(tmp)
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(tmp)
        (tmp / VERSION_FILE).write_text(f"{version}\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)


def untied_directory(version_dir: str | Path) -> Path | None:
    """For a reader that loads a tied alias only under its own name from files (vLLM's ``reload_weights`` on CPU
    repacks a tied head's weight only when the head is loaded): None when the version ``version_dir`` has no
    ``tied`` names; else the version's own :data:`UNTIED_DIR` (made by the first caller, shared by every later one):
    the version's files linked, each alias's tensor (read from its canonical name's file) in :data:`TIED_FILE`, and
    an index naming every tensor. The version's own files hold each tied tensor once
    (:func:`~psrl.weights.format.tied_names`).

    It lives inside the version's directory and goes with it when the version is pruned, never before: a server
    may go on reading it after its caller stopped waiting (a reload cancelled as the run ends), and a directory
    removed under it failed the reload half-way and left vLLM's engine dead for every later call (seen in CI)."""
    src = Path(version_dir).resolve()
    manifest = read_manifest(src)
    tied: dict[str, str] = manifest.get("tied") or {}
    if not tied:
        return None
    out = src / UNTIED_DIR
    if (out / INDEX).exists():
        return out
    where = {n: b["file"] for b in manifest["buckets"] for n in b["names"]}
    tmp = Path(tempfile.mkdtemp(prefix=f".{UNTIED_DIR}-", dir=src))
    try:
        for name in sorted(set(where.values())):
            os.symlink(Path("..") / name, tmp / name)
        _copy_tensors(
            {alias: (src / where[canonical], canonical) for alias, canonical in tied.items()}, tmp / TIED_FILE
        )
        weight_map = {**where, **dict.fromkeys(tied, TIED_FILE)}
        (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        os.rename(tmp, out)
    except OSError:
        if not (out / INDEX).exists():  # not a rename refused because another engine made it first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: (where its data starts, ``{name: {dtype, shape, data_offsets}}``)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _copy_tensors(tensors: dict[str, tuple[Path, str]], out: Path) -> None:
    """Write a safetensors file of ``{name: (file, name there)}``, each tensor's bytes copied from its file by the
    kernel (``os.copy_file_range``; where it is refused, a MiB at a time): the process never holds the tensor (a
    tied embedding is ~10-20 % of a model)."""
    header: dict[str, Any] = {}
    sources, at = [], 0
    for name, (path, there) in tensors.items():
        start, entries = _header(path)
        lo, hi = entries[there]["data_offsets"]
        header[name] = {**{k: entries[there][k] for k in ("dtype", "shape")}, "data_offsets": [at, at + hi - lo]}
        sources.append((path, start + lo, hi - lo))
        at += hi - lo
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(out, "wb", buffering=0) as dst:
        dst.write(struct.pack("<Q", len(head)) + head)
        for path, offset, size in sources:
            with open(path, "rb", buffering=0) as f:
                _copy_range(f, dst, offset, size)


def _copy_range(src: Any, dst: Any, offset: int, size: int) -> None:
    """``size`` bytes of ``src`` from ``offset`` appended to ``dst`` (both unbuffered files)."""
    try:
        while size > 0:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size, offset)
            if n <= 0:
                raise ValueError(f"{src.name}: shorter than its header says")
            offset, size = offset + n, size - n
        return
    except OSError:  # another filesystem pair, or a kernel without it: copy what is left by hand
        pass
    src.seek(offset)
    while size > 0:
        block = src.read(min(1 << 20, size))
        if not block:
            raise ValueError(f"{src.name}: shorter than its header says")
        dst.write(block)
        size -= len(block)
