"""The vLLM side of ``weights.transport=collective``: a worker extension (``--worker-extension-cls
psrl.weights.vllm_receiver.WeightReceiver``; vLLM mixes it into its worker class) whose methods the engine calls
through ``POST /collective_rpc`` (vLLM dev mode). Imported inside the vLLM server's workers, from vLLM's own
environment: it needs torch, safetensors and :mod:`psrl.weights` only (no vLLM import, nothing else of psrl; the
server gets psrl's ``src`` on its ``PYTHONPATH``), so the digests are computed by the same functions as everywhere.

* ``psrl_join(address, rank)`` -- join the run's transfer group (:class:`~psrl.weights.collective.TransferGroup`);
* ``psrl_receive(version, buckets, world)`` -- receive a version from the trainer's ranks into buffers of its
  own, apart from the model (the engine keeps serving the weights it has): returns the buckets' digests;
* ``psrl_load(version, digest, tied)`` -- between ``/pause`` and ``/resume``: check the staged version against the
  writer's version digest, then load it (each ``tied`` alias too, as its canonical name's tensor) with the model runner's ``reload_weights(weights_iterator=...)`` (what
  ``reload_weights`` of a directory does, from memory: Hugging Face names in) and drop it; a version that is not
  staged or differs raises, and the weights stay as they were;
* ``psrl_loaded()`` -- ``(version, digest)`` of the weights loaded last; ``psrl_leave()`` -- leave the group.

Memory: a staged version (the model's bytes in the published dtype) from its receipt until it is loaded -- at most
two (a version may arrive while the one before it waits to be loaded).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from psrl.weights.collective import BucketLayout, GroupAddress, TransferGroup, receive_version
from psrl.weights.format import VersionDamaged, version_digest

__all__ = ["WeightReceiver", "STAGED"]

STAGED = 2
"""Versions a worker holds received and not yet loaded."""


class WeightReceiver:
    """Mixed into vLLM's worker (it has ``model_runner.model``); state kept in ``_psrl_*`` attributes."""

    model_runner: Any

    def _psrl_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_psrl")
        if state is None:
            state = self.__dict__["_psrl"] = {"group": None, "staged": OrderedDict(), "loaded": (-1, "")}
        return state

    def psrl_join(self, address: dict, rank: int) -> None:
        st = self._psrl_state()
        if st["group"] is not None:
            st["group"].close()
        st["group"] = TransferGroup(GroupAddress(**address), int(rank))

    def psrl_receive(self, version: int, buckets: list[dict], world: int) -> list[str]:
        st = self._psrl_state()
        if st["group"] is None:
            raise RuntimeError(f"psrl_receive of version {version}: not in a transfer group (psrl_join first)")
        layout = [
            BucketLayout(
                tuple(b["names"]), tuple(tuple(s) for s in b["shapes"]), tuple(b["dtypes"]), tuple(b.get("split", ()))
            )
            for b in buckets
        ]
        tensors: list[tuple[str, torch.Tensor]] = []
        digests: list[str] = []
        for _, got, digest in receive_version(st["group"], layout, int(world)):
            tensors.extend(got.items())
            digests.append(digest)
        staged: OrderedDict = st["staged"]
        staged[int(version)] = (tensors, digests)
        while len(staged) > STAGED:
            staged.popitem(last=False)
        return digests

    def psrl_load(self, version: int, digest: str, tied: dict | None = None) -> str:
        st = self._psrl_state()
        staged: OrderedDict = st["staged"]
        if int(version) not in staged:
            raise KeyError(f"version {version} is not staged on this vLLM worker (staged: {list(staged)})")
        tensors, digests = staged[int(version)]
        if version_digest(digests) != digest:
            raise VersionDamaged(f"vLLM worker: version {version} differs from what its writer sent")
        held = dict(tensors)  # a tied alias was sent once: vLLM loads it under its own name too (CPU repacks a head)
        aliases = [(alias, held[canonical]) for alias, canonical in (tied or {}).items()]
        self.model_runner.reload_weights(weights_iterator=iter(tensors + aliases))  # vLLM's in-place reload
        for v in [v for v in staged if v <= int(version)]:
            del staged[v]
        st["loaded"] = (int(version), digest)
        return digest

    def psrl_loaded(self) -> tuple[int, str]:
        return self._psrl_state()["loaded"]

    def psrl_leave(self) -> None:
        st = self._psrl_state()
        group, st["group"] = st["group"], None
        st["staged"].clear()
        if group is not None:
            group.close()
