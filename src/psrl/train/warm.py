"""The supervised warm start on the ranks (issue #33, item 5): with a driver that holds no weights (vLLM or Ray
engines, world size > 1), the ranks warm-start their own shards instead of the driver's policy, so no process ever
holds the whole model for it.

Each step is the one :func:`psrl.train.steps.warm_start_policy` takes in one process: the driver draws the step's
demonstrations (:func:`~psrl.train.steps.warm_start_chunks`); rank ``r`` runs rows ``r, r + W, ...`` of them in one
forward, its loss ``-sum(logp * mask)`` over the step's *whole* mask sum, backward scaled by the world size (FSDP
averages gradients), so the sharded gradient is the single process's; the norm is clipped over every shard, and an
AdamW of its own (``trainer.warm_start_lr``) steps, dropped afterwards so the RL optimiser starts fresh. Every rank
runs one forward per step (a rank with no row runs the first row at weight 0): ranks that run different numbers of
collectives deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from psrl.train.steps import pad_rows

__all__ = ["Demos", "warm_start_shards"]


@dataclass(frozen=True)
class Demos:
    """The demonstrations as every rank gets them: token ids and the loss mask of each response token."""

    prompts: list[list[int]]
    responses: list[list[int]]
    masks: list[list[float]]

    @staticmethod
    def of(demos: Sequence[tuple]) -> Demos:
        """From a task's ``(prompt ids, response ids, mask)`` demonstrations."""
        return Demos([list(d[0]) for d in demos], [list(d[1]) for d in demos], [list(d[2]) for d in demos])


class Optimised(Protocol):
    """The trainer's settings a warm-start step uses (a :class:`~psrl.train.worker.WorkerSpec`)."""

    @property
    def weight_decay(self) -> float: ...
    @property
    def grad_clip(self) -> float: ...


Forward = Callable[[tuple[int, ...]], Tensor]
"""``rows -> [b, T]`` log-probs of the rows' response tokens at temperature 1 (:meth:`RankWorker._forward`)."""


def warm_start_shards(
    model: nn.Module,
    forward: Forward,
    masks: Sequence[Sequence[float]],
    chunks: Sequence[Sequence[int]],
    place: tuple[int, int],
    lr: float,
    spec: Optimised,
) -> list[float]:
    """The warm start's steps over ``chunks`` (each a list of demonstration indices) on rank ``place = (rank,
    world)``, with ``spec``'s weight decay and clipping; returns each step's loss (the mean over the step's unmasked
    tokens, the same on every rank)."""
    rank, world = place
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay)
    dev = next(iter(params)).device
    losses = []
    for chunk in chunks:
        mine = tuple(chunk[rank::world])
        rows, weight = (mine, 1.0) if mine else (tuple(chunk[:1]), 0.0)
        den = max(float(sum(sum(masks[i]) for i in chunk)), 1.0)
        logp = forward(rows)
        mask = pad_rows([list(masks[i]) for i in rows], dev)[:, : logp.shape[1]]
        loss = -(logp * mask).sum() * weight / den
        opt.zero_grad(set_to_none=True)
        (loss * world).backward()  # FSDP averages over ranks; each rank's loss already holds its share of the mean
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total))
    opt.zero_grad(set_to_none=True)
    return losses
