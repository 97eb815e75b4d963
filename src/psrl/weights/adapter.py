"""A LoRA adapter as a published version (issue #36, item 3): what the ranks publish instead of the whole model, and
how an engine without peft applies it to the base it holds.

Names. The trainer's model carries peft's layers (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``);
a version names tensors as the plain model does: a base weight as ``...q_proj.weight``, the adapter of module
``M`` as ``M.lora_A.weight`` (``[r, in]``) and ``M.lora_B.weight`` (``[out, r]``), **B already multiplied by
lora_alpha / lora_rank** -- so ``W = W_base + B @ A`` with no setting to carry (the in-memory store has no
manifest); :func:`peft_files` writes it back as a peft adapter with the run's ``lora_alpha``.

What a version holds (:func:`published_names`): the adapter, and -- the first version a set of ranks publishes
after it starts (a run's start, a resume, a restart after a failure) -- the base weights as well, so an engine's
base is the ranks' base whatever it held before (a warm start, a resume from another world size). The manifest
says so (:func:`adapter_meta`): ``kind: lora``, ``base`` (``model.path``, or ``built-in``), ``base_included``
and the LoRA settings. ``weights/bytes`` of every later version is the adapter's.

:class:`MergedAdapter` applies a version to a plain model: it keeps a copy of each adapted module's base weight
and sets ``W = W_base + B @ A`` from it at every version, so the weights served are exactly the trainer's merged
forward's, version after version (no drift from undoing the previous adapter).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from psrl.weights.format import INDEX, VersionDamaged, bucket_file, read_buckets, read_manifest, version_digest

__all__ = [
    "LORA_PARTS",
    "is_adapter",
    "published_names",
    "adapter_meta",
    "MergedAdapter",
    "peft_files",
    "unpack_version",
]

LORA_PARTS = (".lora_A.weight", ".lora_B.weight")
"""How a published adapter tensor's name ends."""


def is_adapter(name: str) -> bool:
    """Whether a published tensor is an adapter's (else a base weight)."""
    return name.endswith(LORA_PARTS)


def published_names(state_names: Iterable[str], scale: float, with_base: bool) -> dict[str, tuple[str, float]]:
    """``{trainer state name: (published name, factor)}`` for a model with peft's LoRA layers (adapter ``default``):
    the adapter's tensors (B times ``scale``), and with ``with_base`` every other tensor, under its plain name."""
    out: dict[str, tuple[str, float]] = {}
    for n in state_names:
        for part, factor in ((".lora_A.default.weight", 1.0), (".lora_B.default.weight", scale)):
            if n.endswith(part):
                out[n] = (n.removesuffix(part) + part.replace(".default", ""), factor)
                break
        else:
            if ".lora_" not in n and with_base:
                out[n] = (n.replace(".base_layer.", "."), 1.0)
    return out


def adapter_meta(base: str, rank: int, alpha: int, targets: Iterable[str], with_base: bool) -> dict:
    """The manifest fields of an adapter version (:func:`psrl.weights.format.finish_version`'s ``meta``)."""
    return {
        "kind": "lora",
        "base": base,
        "base_included": bool(with_base),
        "lora": {
            "lora_rank": int(rank),
            "lora_alpha": int(alpha),
            "target_modules": list(targets),
            "lora_B_scaled": True,
        },
    }


class MergedAdapter:
    """Applies published versions (:func:`published_names`' names) to a plain ``model`` in place.

    ``load(state)``: base tensors (if the version has them) are loaded and become the kept base; then each adapted
    module's weight is set to ``W_base + B @ A`` (the base copied the first time a module is adapted). Raises
    ``ValueError`` naming the tensors when the version's names are not this model's, before changing anything.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.base: dict[str, Tensor] = {}

    def check(self, names: Iterable[str]) -> None:
        """The published ``names`` fit the model: base names are its tensors (all of them, if any), and every
        adapter belongs to one of its Linear / Conv1D modules."""
        names = list(names)
        have = set(self.model.state_dict())
        base = {n for n in names if not is_adapter(n)}
        if base and base != have:
            raise ValueError(
                f"the version's base tensors are not the engine's model's (missing {sorted(have - base)[:3]}, "
                f"unknown {sorted(base - have)[:3]})"
            )
        modules = dict(self.model.named_modules())
        bad = [n for n in names if is_adapter(n) and _module_of(n) not in modules]
        if bad:
            raise ValueError(f"adapter tensors of modules the engine's model does not have: {bad[:3]}")

    def load(self, state: Mapping[str, Tensor]) -> None:
        """One version held whole (the in-memory store's)."""
        self.load_buckets([state], list(state))

    @torch.no_grad()
    def load_buckets(self, buckets: Iterable[Mapping[str, Tensor]], names: Iterable[str]) -> None:
        """A version bucket by bucket (``names``: all of its tensors, checked first): base tensors go into the model
        as they come, the adapter's (small) are kept and merged once the base is whole."""
        self.check(names)
        adapter: dict[str, Tensor] = {}
        base_seen = False
        for tensors in buckets:
            base = {n: t for n, t in tensors.items() if not is_adapter(n)}
            if base:
                self.model.load_state_dict(base, strict=False)
                base_seen = True
            adapter.update({n: t for n, t in tensors.items() if is_adapter(n)})
        if base_seen:  # a new base: the kept copies are of the old one
            self.base.clear()
        self.merge(adapter)

    @torch.no_grad()
    def merge(self, adapter: Mapping[str, Tensor]) -> None:
        """Set each adapted module's weight to its kept base plus ``B @ A`` (computed in fp32)."""
        modules = dict(self.model.named_modules())
        for a_name in sorted(n for n in adapter if n.endswith(LORA_PARTS[0])):
            module = _module_of(a_name)
            a, b = adapter[a_name].float(), adapter[module + LORA_PARTS[1]].float()
            weight = modules[module].weight
            if module not in self.base:
                self.base[module] = weight.detach().clone()
            delta = b @ a  # [out, in]
            if not isinstance(modules[module], nn.Linear):  # transformers' Conv1D keeps its weight as [in, out]
                delta = delta.T
            weight.copy_((self.base[module].float() + delta.to(weight.device)).to(weight.dtype))


def _module_of(name: str) -> str:
    for part in LORA_PARTS:
        if name.endswith(part):
            return name.removesuffix(part)
    raise ValueError(f"{name} is not an adapter tensor")


def peft_files(state: Mapping[str, Tensor], meta: Mapping, directory: str | Path) -> Path:
    """Write a version's adapter as a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``:
    what ``PeftModel.from_pretrained`` and vLLM's ``load_lora_adapter`` read), with the run's ``lora_alpha`` (B
    divided back by the scale the version multiplied it with)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    lora = meta["lora"]
    scale = float(lora["lora_alpha"]) / int(lora["lora_rank"])
    tensors = {
        f"base_model.model.{n}": (t.float() / scale if n.endswith(LORA_PARTS[1]) else t.float()).contiguous()
        for n, t in state.items()
        if is_adapter(n)
    }
    targets = sorted({_module_of(n).rsplit(".", 1)[-1] for n in state if is_adapter(n)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": meta.get("base"),
        "r": int(lora["lora_rank"]),
        "lora_alpha": int(lora["lora_alpha"]),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "inference_mode": True,
    }
    # each file replaced whole (a reader sees the old file or the new one): vLLM may read the directory again
    # whenever it reloads the adapter (rollout/engines/vllm_lora.py)
    _replace(d / "adapter_model.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    _replace(d / "adapter_config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=1)))
    return d


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def unpack_version(directory: str | Path, base_out: str | Path) -> tuple[dict[str, Tensor], dict, Path | None]:
    """An adapter version for an engine that takes the adapter and the base apart (vLLM): ``(adapter, manifest,
    base)``, every bucket checked against the manifest (:class:`~psrl.weights.format.VersionDamaged` before
    anything is returned). ``adapter``: the adapter's tensors (published names); ``base``: when the version carries
    the base, ``base_out`` holding it alone as a Hugging Face directory (safetensors shards and their index: what
    vLLM's ``reload_weights`` reads), written bucket by bucket; else None."""
    manifest = read_manifest(directory)
    if manifest.get("kind") != "lora":
        raise ValueError(f"{directory} is not an adapter version (its manifest has no kind: lora)")
    if version_digest([b["digest"] for b in manifest["buckets"]]) != manifest["digest"]:
        raise VersionDamaged(f"{directory}: the buckets' digests do not make the manifest's version digest")
    with_base = bool(manifest.get("base_included"))
    out = Path(base_out)
    if with_base:
        out.mkdir(parents=True, exist_ok=True)
    count = len(manifest["buckets"])
    adapter: dict[str, Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in read_buckets(directory):
        adapter.update({n: t for n, t in tensors.items() if is_adapter(n)})
        base = {n: t.contiguous() for n, t in tensors.items() if not is_adapter(n)}
        if with_base and base:
            save_file(base, str(out / bucket_file(i, count)))
            weight_map.update(dict.fromkeys(base, bucket_file(i, count)))
            total += sum(t.numel() * t.element_size() for t in base.values())
    if not with_base:
        return adapter, manifest, None
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return adapter, manifest, out
