"""fp32 master weights for an unsharded rank whose model is 16-bit (issue #33, item 1: world size 1 with
``model.dtype=bfloat16``).

Sharded ranks get mixed precision from FSDP2 (:func:`psrl.train.shard.mixed_precision`); a world-size-1 rank trains
the driver policy's own model, which is in ``model.dtype``. Trained in place in bf16, an update smaller than half a
unit in the last place of a weight (~4e-3 of it: AdamW's first steps are ~``lr`` each) rounds away. So here, as
Apex's O2 and FSDP2 do:

* the optimiser, checkpoints, publication and digests see an fp32 copy of the parameters (:attr:`Masters.model`);
* the forward and backward run on the 16-bit model (:attr:`Masters.compute`: the policy's own, served by in-process
  engines), whose gradients are added into the masters' fp32 gradients after every backward (micro-batches
  accumulate in fp32, as FSDP2's ``reduce_dtype=float32`` does);
* after an optimiser step (or a restore, or a load) the masters are copied back, rounded, into the 16-bit model.

An fp32 model needs none of it: :func:`masters_for` returns None and the rank trains the model itself (no copy).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["Masters", "masters_for"]

_HALF = (torch.bfloat16, torch.float16)


class Masters:
    """The fp32 twin of a 16-bit ``compute`` model (same modules, same tying; buffers copied as they are)."""

    def __init__(self, compute: nn.Module):
        self.compute = compute
        params = list(compute.parameters())  # tied parameters once: the twin ties the same ones
        memo: dict[int, object] = {id(p): nn.Parameter(p.detach().float(), p.requires_grad) for p in params}
        self.model: nn.Module = copy.deepcopy(compute, memo)  # no 16-bit copy of the weights made on the way
        self._pairs = list(zip(self.model.parameters(), params))

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the 16-bit model's gradients (from the last backward) into the masters' fp32 ones, and drop them."""
        for master, p in self._pairs:
            if p.grad is None:
                continue
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def sync(self) -> None:
        """The 16-bit model takes the masters' values (rounded to nearest, as a cast of a published version)."""
        for master, p in self._pairs:
            p.copy_(master)


def masters_for(model: nn.Module) -> Masters | None:
    """:class:`Masters` for a model with 16-bit floating parameters; None for an fp32 one (trained as it is)."""
    if any(p.dtype in _HALF for p in model.parameters()):
        return Masters(model)
    return None
