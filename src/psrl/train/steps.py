"""What a training step is made of, besides the ranks' own work: advantages per group, the train-inference
mismatch metric, metric means over minibatches, ragged rows padded, the generator states a checkpoint carries, an
optimiser step at a scaled learning rate, and the supervised warm start of the driver's policy."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from psrl.algo.advantages import ADV_ESTIMATORS
from psrl.algo.corrections import rollout_correction_from_config
from psrl.train.planner import Plan, loss_weights

if TYPE_CHECKING:
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models import Policy

__all__ = [
    "StepInput",
    "step_input",
    "batch_advantages",
    "logprob_mismatch",
    "mean_metrics",
    "pad_rows",
    "rng_state",
    "set_rng_state",
    "step_scaled",
    "warm_start_chunks",
    "warm_start_policy",
]


def batch_advantages(batch: Any, algo_cfg: AlgorithmConfig, who: str) -> tuple[list, list[float]]:
    """The rows the trainer trains on, group after group (empty groups left out), and each one's advantage.

    The advantage is ``algorithm.adv_estimator``'s over the group's trajectories (a trajectory counts once
    however many sequences it has); a row is one training sequence (:meth:`psrl.types.Trajectory.rows`: one per
    trajectory, or several for an agent episode split under ``task.agent_history: split``), and every row of a
    trajectory gets that trajectory's advantage. ``who`` names the caller when the batch is empty."""
    groups = [list(g) for g in batch.groups if len(g) > 0]
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError(f"{who}: the batch holds no trajectories")
    estimate = ADV_ESTIMATORS[algo_cfg.adv_estimator]
    advs = [
        float(a)
        for g in estimate([[t.reward for t in g] for g in groups], norm_by_std=algo_cfg.norm_adv_by_std)
        for a in g
    ]
    rows = [(row, a) for t, a in zip(trajs, advs) for row in t.rows()]
    return [r for r, _ in rows], [a for _, a in rows]


def rng_state(rng: random.Random, sampler: torch.Generator) -> dict[str, Any]:
    """The generator states a trainer's checkpoint carries: its own ``rng``, the policy's ``sampler`` and torch's."""
    return {"rng": rng.getstate(), "sampler": sampler.get_state().clone(), "torch_rng": torch.get_rng_state()}


def set_rng_state(ckpt: dict[str, Any], rng: random.Random, sampler: torch.Generator) -> None:
    """Restore what :func:`rng_state` saved into ``ckpt``."""
    rng.setstate(ckpt["rng"])
    sampler.set_state(ckpt["sampler"])
    torch.set_rng_state(ckpt["torch_rng"])


def pad_rows(rows: Iterable[list], device: str | torch.device = "cpu") -> torch.Tensor:
    """Right-pad ragged float rows with 0 into ``[B, T]``."""
    rows = list(rows)
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def logprob_mismatch(
    recomputed: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor, version: int
) -> dict[str, float]:
    """Train-inference mismatch: mean and max |behaviour - recomputed log-prob| over the generated tokens the
    engines produced at the trainer's own ``version`` (the only tokens where both sides used the same weights).

    ~0 for the in-process engine, ~1e-5 for vLLM in fp32; it jumps when an engine missed a weight update
    (its tokens claim a version whose weights it never loaded). No such tokens in the batch: 0 and 0.
    """
    width = min(recomputed.shape[1], behav.shape[1], versions.shape[1])
    same = (mask[:, :width] > 0) & (versions[:, :width] == int(version))
    diff = (recomputed[:, :width] - behav[:, :width]).abs()[same]
    n = diff.numel()
    return {
        "engine/logprob_mismatch_mean": float(diff.mean()) if n else 0.0,
        "engine/logprob_mismatch_max": float(diff.max()) if n else 0.0,
        "engine/mismatch_tokens": float(n),
    }


def mean_metrics(per_mb: list[dict[str, Any]]) -> dict[str, float]:
    """Each metric's mean over the minibatches that report it."""
    keys = {k for m in per_mb for k in m}
    return {k: sum(float(m[k]) for m in per_mb if k in m) / sum(1 for m in per_mb if k in m) for k in sorted(keys)}


def step_scaled(optimizer: torch.optim.Optimizer, lr_scale: float) -> None:
    """One optimiser step at every group's learning rate times ``lr_scale`` (``ess_lr``), the rates restored after
    it (also when the step raises): the scale is this step's only."""
    groups = optimizer.param_groups
    base = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = g["lr"] * lr_scale
    try:
        optimizer.step()
    finally:
        for g, lr in zip(groups, base):
            g["lr"] = lr


def warm_start_chunks(rng: random.Random, n: int, steps: int, batch_size: int) -> list[list[int]]:
    """The demonstrations (indices into ``n``) of each warm-start step, drawn from ``rng``: the driver draws them at
    every world size, so ranks warm-starting their shards (:mod:`psrl.train.warm`) see the rows one process would."""
    return [[rng.randrange(n) for _ in range(min(batch_size, n))] for _ in range(steps)]


def warm_start_policy(
    policy: Policy,
    cfg: TrainerConfig,
    rng: random.Random,
    demos: list,
    steps: int,
    batch_size: int = 32,
    lr: float | None = None,
) -> list[float]:
    """Supervised steps (masked next-token cross-entropy) on ``demos`` in the driver's policy, before the ranks
    start from its weights; returns the loss per step. Its own AdamW (``lr``, default ``trainer.warm_start_lr``),
    dropped afterwards, so the RL optimiser starts fresh."""
    if steps <= 0 or not demos:
        return []
    model = policy.model
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.warm_start_lr if lr is None else lr, weight_decay=cfg.weight_decay
    )
    losses = []
    for picked in warm_start_chunks(rng, len(demos), steps, batch_size):
        chunk = [demos[i] for i in picked]
        logp = policy.sequence_logprobs([d[0] for d in chunk], [d[1] for d in chunk], 1.0)
        mask = pad_rows([d[2] for d in chunk], policy.device)[:, : logp.shape[1]]
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    opt.zero_grad(set_to_none=True)
    return losses


@dataclass(frozen=True)
class StepInput:
    """One batch as every rank sees it: token ids and per-row floats, indexed by the plan's row numbers."""

    plan: Plan
    prompts: list[list[int]]
    responses: list[list[int]]
    old: list[list[float]] | None = None
    """Pre-update log-probs (from ``logprobs``); None for a ``logprobs`` call."""
    behav: list[list[float]] | None = None
    adv: list[float] | None = None
    mask: list[list[float]] | None = None
    """Loss mask, times any batch-global keep mask (M2PO) the driver applied."""
    weights: tuple[dict[int, list[float]], ...] = ()
    """Per minibatch: ``row -> per-token weight`` with the minibatch's global denominators."""
    lr_scale: float = 1.0


def _pad(data: list[list[float]], width: int) -> Tensor:
    """Ragged float rows, cut or right-padded with 0 to ``[len(data), width]``."""
    out = torch.zeros((len(data), width), dtype=torch.float32)
    for j, r in enumerate(data):
        out[j, : min(len(r), width)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def step_input(
    plan: Plan,
    prompts: list[list[int]],
    responses: list[list[int]],
    old: dict[int, list[float]],
    behav: list[list[float]],
    adv: list[float],
    mask: list[list[float]],
    algo: AlgorithmConfig,
    lr_scale: float = 1.0,
) -> StepInput:
    """The driver's half of a step: the effective masks (loss mask times the rollout correction's rejection keep,
    per row, as :func:`~psrl.algo.losses.token_loss` computes it on the ranks) and, per minibatch, the planner's
    loss weights over them -- global denominators, so every world size gives the same gradient."""
    n = len(prompts)
    old_rows = [old[i] for i in range(n)]
    width = max((len(r) for r in responses), default=0)
    o, b, m = _pad(old_rows, width), _pad(behav, width), _pad(mask, width)
    _, keep, _ = rollout_correction_from_config(o, b, m, algo.rollout_correction)
    eff = m * keep
    weights = tuple(
        loss_weights({i: eff[i, : len(responses[i])].tolist() for i in plan.rows(k)}, algo.loss_agg_mode)
        for k in range(len(plan.minibatches))
    )
    return StepInput(plan, prompts, responses, old_rows, behav, adv, mask, weights, lr_scale)


class _Same:
    """World size 1's model builder: the policy's own model (the rank trains it in place; nothing is copied -- a
    16-bit model gets an fp32 twin the optimiser steps, :mod:`psrl.train.masters`, and takes its values back)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, device: str) -> torch.nn.Module:
        return self.model
