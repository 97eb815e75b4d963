"""LoRA on the rank worker (issue #36, item 2): ``model.lora_rank > 0`` trains a peft adapter over a frozen base.

The rank adds peft's LoRA layers (:func:`add_adapter`) before it shards the model, so FSDP2 shards base and adapter
alike; only the adapter's parameters require gradients, so AdamW holds state for them alone and the base never
moves. Everything else -- the planner, the loss weights, the corrections, the divergence metrics -- sees a model
whose forward is ``base + (lora_alpha / lora_rank) B A``, as before.

At world size 1 the rank's model is the driver policy's own (no copy): :func:`add_adapter` then wraps a twin of it
that shares every parameter and buffer (:func:`sharing_twin`), so the driver's policy stays a plain model of base
names -- what the engines' replicas and ``final/`` expect -- while its base weights are the rank's.

What the ranks publish is :mod:`psrl.weights.adapter`'s (the adapter, B scaled); the driver merges the newest
version into its policy for validation and ``final/``, and writes ``final/adapter/`` from it.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from psrl.errors import ConfigError

__all__ = ["LoraSpec", "lora_spec", "linear_names", "check_targets", "add_adapter", "sharing_twin"]

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    """``model.lora_rank``, ``model.lora_alpha``, ``model.target_modules`` (picklable: it crosses to the ranks)."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    base: str = "built-in"
    """What the adapter applies to (``model.path``), named in every version's manifest."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets: Any = ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0, bias="none")


def lora_spec(model_cfg: Any) -> LoraSpec | None:
    """The :class:`LoraSpec` of ``model.*``; None for full fine-tuning (``model.lora_rank=0``)."""
    if model_cfg.lora_rank <= 0:
        return None
    return LoraSpec(
        int(model_cfg.lora_rank),
        int(model_cfg.lora_alpha),
        tuple(model_cfg.target_modules),
        model_cfg.path if model_cfg.path is not None else "built-in",
    )


def linear_names(model: nn.Module) -> list[str]:
    """The last names of the model's Linear (and transformers' Conv1D) modules, the output head excepted: what
    ``model.target_modules`` may name."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    out = set()
    for name, m in model.named_modules():
        if m is head or not name:
            continue
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out.add(name.rsplit(".", 1)[-1])
    return sorted(out)


def check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """A target that matches no module of ``model`` is a :class:`ConfigError` naming the modules it has."""
    have = linear_names(model)
    if not have:
        raise ConfigError("model.lora_rank", "the model has no linear layers to adapt", "set model.lora_rank=0")
    if spec.target_modules == (ALL_LINEAR,):
        return
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n}
    missing = [t for t in spec.target_modules if t not in names]
    if missing:
        raise ConfigError(
            "model.target_modules",
            f"{missing} match no module of the model; its linear modules are {have}",
            f"set model.target_modules={ALL_LINEAR} or a list of {have}",
        )


def sharing_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules holding the very same parameter and buffer tensors (nothing is copied)."""
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def add_adapter(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Add peft's LoRA layers (adapter ``default``, B zero: the forward is unchanged) to ``model`` in place and
    freeze everything else; returns ``model``. ``lora_A`` is drawn from torch's global generator."""
    check_targets(model, spec)
    from peft import inject_adapter_in_model

    with warnings.catch_warnings():  # transformers' Conv1D (GPT-2): peft switches fan_in_fan_out on and says so
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        inject_adapter_in_model(spec.peft_config(), model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model
