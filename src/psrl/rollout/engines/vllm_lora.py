"""LoRA versions on a vLLM server (``model.lora_rank > 0``, issue #36): the adapter one server serves, and where its
files live.

A server started with ``--enable-lora`` serves the base model and one adapter under one name (:data:`ADAPTER`);
every request of psrl names the adapter as its ``model``. Each version is loaded with ``POST
/v1/load_lora_adapter`` and ``load_inplace`` between ``/pause`` and ``/resume`` (the full-weight path's
``reload_weights``): the adapter keeps its name and vLLM's id, so the requests in flight continue on the new
adapter, as they continue on new weights, and adapters do not pile up.

**One directory per server, rewritten in place.** vLLM keeps, with every request, the adapter's path as it was when
the request arrived, and reads the adapter from that path again at every step of a batch whose newest request
carries ``load_inplace`` (vLLM 0.32, ``LRUCacheWorkerLoRAManager.add_adapter``), and after a base reload. With a
directory per version, a request that arrived before an update would put the previous version's adapter back
under the new version's label. So each server's adapter lives at one path (:attr:`ServedAdapter.path`), each file
replaced whole while the server is paused: whatever vLLM reads is the version it is labelled with. A load the
server refuses puts the previous files back (:meth:`ServedAdapter.restore`), so the old adapter stays served.

**The base.** A version that carries the base (the first of a set of ranks: :mod:`psrl.weights.adapter`) is loaded
as a base-only directory with ``reload_weights`` first (vLLM reloads the base under its LoRA layers and drops the
adapter; the in-place load then brings it back).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from psrl.weights.adapter import peft_files, unpack_version

__all__ = ["ADAPTER", "LORA_RANKS", "ServedAdapter", "max_lora_rank"]

ADAPTER = "psrl-adapter"
"""The name every request gives as its ``model`` when the server serves an adapter."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``--max-lora-rank``."""

FILES = ("adapter_model.safetensors", "adapter_config.json")


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves an adapter of rank ``rank``."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {rank}")


class ServedAdapter:
    """The adapter files of one vLLM server, under ``directory`` (the server reads ``path``; ``base`` is scratch for
    a version's base)."""

    def __init__(self, directory: str | Path, name: str = ADAPTER):
        self.directory = Path(directory)
        self.name = name
        self.path = self.directory / "adapter"
        self._previous: dict[str, bytes] = {}

    def stage(self, version_dir: str | Path) -> Path | None:
        """Check the version and write its adapter at :attr:`path` (the previous files kept in memory for
        :meth:`restore`); returns the base-only directory to reload first when the version carries the base (a new
        scratch directory each time: an earlier one may still be read by a reload psrl stopped waiting for)."""
        scratch = self.directory / f"base-{uuid.uuid4().hex[:8]}"
        adapter, manifest, base = unpack_version(version_dir, scratch)
        self._previous = {f: (self.path / f).read_bytes() for f in FILES if (self.path / f).exists()}
        peft_files(adapter, manifest, self.path)
        return base

    def restore(self) -> None:
        """Put back the adapter files :meth:`stage` replaced (a load the server refused: it serves the old one)."""
        for f, data in self._previous.items():
            tmp = self.path / f".{f}.tmp"
            tmp.write_bytes(data)
            tmp.replace(self.path / f)

    def done(self) -> None:
        """After the server answered a load: drop the kept files and every scratch base (the server runs its calls
        one after another, so none of them is read any more)."""
        self._previous = {}
        for scratch in self.directory.glob("base-*"):
            shutil.rmtree(scratch, ignore_errors=True)
