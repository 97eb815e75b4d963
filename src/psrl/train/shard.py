"""FSDP2 sharding of a trainer model (issue #22, item 2), on PyTorch's own APIs only.

* :func:`shard_model` -- ``fully_shard`` per transformer block (the classes the model names in
  ``_no_split_modules``), then the root, so the tied embedding and head (outside every block) share one unit;
* :func:`load_full_state` -- rank 0 holds the weights read from disk, the others were built on ``meta``:
  ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends them (a model is read once, not N times);
* :func:`full_state` -- the gathered state (``DTensor.full_tensor``), every rank in the same order.

* :func:`mixed_precision` / :func:`master_dtype` -- on GPUs with ``model.dtype`` bf16 or fp16: fp32 master weights
  and AdamW state, forward and backward in ``model.dtype`` (FSDP2's ``MixedPrecisionPolicy``), gradients reduced in
  fp32; on CPU (gloo) the model's own dtype throughout, no policy.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from psrl.models.builder import DTYPES

__all__ = [
    "block_classes",
    "shard_model",
    "load_full_state",
    "full_state",
    "full_value",
    "mixed_precision",
    "master_dtype",
    "single_process_quiet",
]


def mixed_precision(device: str, dtype: str) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy for ``model.device`` / ``model.dtype``: on CUDA with a 16-bit ``dtype``,
    parameters cast to it for forward and backward and gradients reduced in fp32 (a bf16 all-reduce over many ranks
    loses the small gradients); None (no casting) on CPU, where gloo and the tests run fp32, and for fp32."""
    if not device.startswith("cuda") or dtype == "float32":
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)


def master_dtype(device: str, dtype: str) -> str:
    """The dtype the ranks hold their sharded weights (and AdamW state) in: fp32 under :func:`mixed_precision`,
    else ``model.dtype`` itself."""
    return "float32" if mixed_precision(device, dtype) is not None else dtype


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The module classes named by ``model._no_split_modules`` (a transformers model's transformer blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"{type(model).__name__}: no module of _no_split_modules={sorted(names)} to shard per block")
    return tuple(sorted(found, key=lambda c: c.__name__))


def shard_model(
    model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True, mp: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """``fully_shard`` each block, then the root (which then owns the embeddings, the head and the final norm);
    ``mp``: :func:`mixed_precision`'s policy (None: none)."""
    blocks = block_classes(model)
    policy = mp if mp is not None else MixedPrecisionPolicy()
    for m in model.modules():
        if isinstance(m, blocks):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor] | None, device: str = "cpu") -> None:
    """Fill a sharded ``model`` from rank 0's full ``state`` (``None`` on the other ranks, whose model was built on
    ``meta`` and is materialised here, empty, before the broadcast)."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # torch types the state dict[str, ValueType], invariant in its values, so a dict[str, Tensor] (which it is,
    # and which set_model_state_dict only renames keys of) does not match
    set_model_state_dict(model, state if state is not None else {}, options=opts)  # type: ignore[arg-type]
    if dist.is_initialized():  # non-persistent buffers (Llama's rotary inv_freq) are in no state dict: after
        for buf in model.buffers():  # to_empty they hold garbage on the meta-built ranks, so rank 0 sends them too
            dist.broadcast(buf, src=0)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered to a full CPU tensor (a collective: every rank calls it, same order)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().to("cpu", copy=True)
    return out


@contextlib.contextmanager
def single_process_quiet(world: int) -> Iterator[None]:
    """At world size 1 DCP warns that it assumes one process on every call: that is the intent, say nothing."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def full_value(norm: Tensor) -> float:
    """The clip norm as a float: a DTensor under FSDP (its full value is the norm over every shard)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
