"""The trainer: one consumed batch of groups -> GRPO advantages -> ``minibatches`` AdamW steps.

Three log-probs per token, as the decoupled off-policy objective needs (see :mod:`psrl.algo.losses`):

* ``behav_logp`` -- recorded at generation (``traj.logprobs``), by whatever version produced it;
* ``old_logp``   -- the trainer's pre-update policy, computed once, without grad, before the
  first minibatch (the PPO ratio is against it; the IS correction is ``old / behav``);
* ``logp``       -- the current weights, with grad, recomputed per minibatch.

Tool tokens are in the response but ``loss_mask`` 0, so they are context only.

A NaN or infinite loss or gradient norm skips the step: no optimiser step is kept (with several
minibatches the weights and optimiser are restored to before the batch), ``last_skip`` says why and
``train/skipped_steps`` counts it. The coordinator records the batch as not trained and stops the
run after ``trainer.max_skipped_steps`` skips in a row.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from psrl.algo.advantages import ADV_ESTIMATORS
from psrl.algo.corrections import batch_corrections
from psrl.algo.divergence import divergence_metrics
from psrl.algo.losses import policy_loss, token_loss
from psrl.types import WeightStore

if TYPE_CHECKING:
    from psrl.config import AlgorithmConfig

__all__ = ["Trainer"]


class Trainer:
    """Owns the optimiser of ``policy``; ``step(batch)`` trains the weights on ``batch.groups``.

    Versions and their publication belong to the coordinator
    (:class:`psrl.runtime.coordinator.Coordinator`): it sets ``policy.version`` and publishes the
    weights once a step is done. The trainer only reads the version (for the mismatch metric).
    """

    def __init__(self, policy, algo_cfg, trainer_cfg):
        self.policy = policy
        self.algo_cfg = algo_cfg
        self.cfg = trainer_cfg
        self.rng = random.Random(trainer_cfg.seed)
        torch.manual_seed(trainer_cfg.seed)
        self.optimizer = self._adamw(trainer_cfg.lr)
        self.last_skip: str | None = None
        """Why the last step was skipped (a NaN / infinite loss or gradient), or None if it trained."""
        self.skipped_steps = 0
        """Steps skipped over the run (checkpointed)."""
        self.skipped_in_a_row = 0
        """Steps skipped since the last one that trained (checkpointed)."""

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.model.parameters(), lr=lr, weight_decay=self.cfg.weight_decay)

    @property
    def version(self) -> int:
        """The version of the weights the trainer holds."""
        return self.policy.version

    # ------------------------------------------------------------------ RL step

    def step(self, batch) -> dict[str, float]:
        """One training step on ``batch`` (``.version``, ``.groups``: lists of Trajectory). Returns the ``train/*``,
        loss and correction metrics and the batch's ``divergence/*`` (:mod:`psrl.algo.divergence`: behaviour vs
        pre-update policy, per staleness level ``batch.version - V_traj`` too); what the batch was is the
        coordinator's row. The batch-global corrections (M2PO's mask, VCPO's learning-rate scale) are computed
        once, before the first minibatch."""
        trajs, flat_adv = batch_advantages(batch, self.algo_cfg, "Trainer.step")
        dev = self.policy.device
        adv = torch.tensor(flat_adv, dtype=torch.float32, device=dev)
        prompts = [t.prompt_ids for t in trajs]
        responses = [t.response_ids for t in trajs]
        mask = _pad([t.loss_mask for t in trajs], dev)
        behav = _pad([t.logprobs for t in trajs], dev)
        temp = self.cfg.temperature
        with torch.no_grad():
            old = self.policy.sequence_logprobs(prompts, responses, temp)
        mismatch = logprob_mismatch(old, behav, mask, _pad([t.token_versions for t in trajs], dev), self.policy.version)
        w = old.shape[1]  # every response's log-probs and mask are as long as the response: the widths agree
        behav_w, mask_w = behav[:, :w], mask[:, :w]
        lag = torch.tensor([int(batch.version) - int(t.v_traj) for t in trajs])  # each row's staleness
        divergence = divergence_metrics(old, behav_w, mask_w, lag)
        keep, lr_scale, corrections = batch_corrections(old, behav_w, mask_w, self.algo_cfg.rollout_correction)
        if keep is not None:  # M2PO: masked tokens leave the loss like padding
            mask = mask_w * keep
        chunks = _split(len(trajs), self.cfg.minibatches)
        before = self._snapshot() if len(chunks) > 1 else None  # a later minibatch may go NaN
        self.last_skip = None
        per_mb, empty = [], 0
        for k, idx in enumerate(chunks):
            logp = self.policy.sequence_logprobs([prompts[i] for i in idx], [responses[i] for i in idx], temp)
            width = logp.shape[1]
            loss, m = policy_loss(
                logp, old[idx, :width], behav[idx, :width], adv[idx], mask[idx, :width], self.algo_cfg
            )
            where = f" (minibatch {k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            if not math.isfinite(float(loss.detach())):
                return self._skip(f"loss is {float(loss.detach())!r}{where}", before, divergence)
            _, eff = token_loss(
                logp.detach(), old[idx, :width], behav[idx, :width], adv[idx], mask[idx, :width], self.algo_cfg
            )
            if not bool((eff > 0).any()):  # no token in the loss: AdamW would still move the weights (as RankWorker)
                empty += 1
                per_mb.append({**m, "train/grad_norm": 0.0, "train/loss": float(loss.detach())})
                continue
            norm = self._optimise(loss, lr_scale)
            if norm is None:
                return self._skip(f"gradient norm is not finite{where}", before, divergence)
            m["train/grad_norm"] = norm
            m["train/loss"] = float(loss.detach())
            per_mb.append(m)
        self.skipped_in_a_row = 0
        return {
            **_mean_metrics(per_mb),
            **mismatch,
            **divergence,
            **corrections,
            "train/adv_abs_mean": float(adv.abs().mean()),
            "train/skipped_steps": self.skipped_steps,
            "train/empty_minibatches": float(empty),
        }

    def _skip(self, reason: str, before: tuple | None, divergence: dict[str, float]) -> dict[str, float]:
        """Leave the weights as they were before ``batch`` and report why; the coordinator still moves the version
        on (the buffer was consumed), publishing the same weights, so the rollout side never waits for it. The
        batch's ``divergence/*`` are reported still: a skipped step is when they are looked for."""
        self.optimizer.zero_grad(set_to_none=True)
        if before is not None:
            self.policy.model.load_state_dict(before[0])
            self.optimizer.load_state_dict(before[1])
        self.last_skip = reason
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        return {**divergence, "train/skipped_steps": self.skipped_steps}

    def _snapshot(self) -> tuple:
        """Weights and optimiser state, copied (only taken with several minibatches: one more model copy)."""
        return copy.deepcopy(self.policy.model.state_dict()), copy.deepcopy(self.optimizer.state_dict())

    def _optimise(self, loss: torch.Tensor, lr_scale: float = 1.0) -> float | None:
        """Backward, clip, step with the learning rate times ``lr_scale`` (``ess_lr``: this step only); None (and no
        step) when the gradient norm is NaN or infinite."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.policy.model.parameters(), self.cfg.grad_clip))
        if not math.isfinite(norm):
            return None
        step_scaled(self.optimizer, lr_scale)
        return norm

    def publish(self, version: int, store: WeightStore) -> float:
        """The policy takes ``version``; its weights (CPU copies) go into ``store``. Returns the seconds taken."""
        started = time.perf_counter()
        self.policy.version = version
        store.publish(version, self.policy.export_state())
        return time.perf_counter() - started

    # ------------------------------------------------------------------ warm start

    def warm_start(self, demos: list, steps: int, batch_size: int = 32, lr: float | None = None) -> list[float]:
        """Supervised steps (masked next-token cross-entropy) on ``demos``; returns the loss per step.

        Uses its own AdamW (``lr``, default ``trainer.warm_start_lr``) so the RL optimiser starts fresh.
        """
        if steps <= 0 or not demos:
            return []
        opt = self._adamw(self.cfg.warm_start_lr if lr is None else lr)
        losses = []
        for _ in range(steps):
            chunk = [demos[self.rng.randrange(len(demos))] for _ in range(min(batch_size, len(demos)))]
            logp = self.policy.sequence_logprobs([d[0] for d in chunk], [d[1] for d in chunk], 1.0)
            mask = _pad([d[2] for d in chunk], self.policy.device)[:, : logp.shape[1]]
            loss = -(logp * mask).sum() / mask.sum().clamp(min=1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.model.parameters(), self.cfg.grad_clip)
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, copied: bool = True) -> dict:
        """What :meth:`save` writes. ``copied``: the optimiser state is a deep copy, so the caller may write it
        while training goes on (a synchronous save writes the live state and skips that copy)."""
        state = {
            "model": self.policy.export_state(),
            "version": self.policy.version,
            **rng_state(self.rng, self.policy.generator),
            "skipped": (self.skipped_steps, self.skipped_in_a_row),
        }
        if self.cfg.save_optimizer:
            opt = self.optimizer.state_dict()
            state["optimizer"] = copy.deepcopy(opt) if copied else opt
        return state

    def save(self, directory: str | Path, state: dict | None = None) -> Path:
        """Write weights, optimiser state (unless ``trainer.save_optimizer`` is false), version, skip counters
        and generator states (``state``, else taken now) to ``directory/trainer.pt``."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state if state is not None else self.state_dict(copied=False), path / "trainer.pt")
        return path / "trainer.pt"

    def load(self, directory: str | Path) -> int:
        """Restore what :meth:`save` wrote; returns the restored version. A checkpoint of the sharded trainer
        (:class:`~psrl.train.sharded.ShardedTrainer`: AdamW in ``ranks/``) is read through a world-size-1 rank
        worker, so a run saved at N ranks resumes here."""
        path = Path(directory)
        ckpt = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        if int(ckpt.get("world_size", 1)) > 1:
            optimizer = self._sharded_optimizer(path / "ranks")
            if optimizer is not None:
                ckpt["optimizer"] = optimizer
        self.load_state_dict(ckpt)
        return self.policy.version

    def _sharded_optimizer(self, directory: Path) -> dict | None:
        """AdamW's state as this trainer's optimiser holds it, read from the ranks' DCP files (None: saved
        without it)."""
        from psrl.train.worker import RankWorker, WorkerSpec  # torch.distributed: only for such a checkpoint

        model = self.policy.model
        spec = WorkerSpec(
            build=lambda device: copy.deepcopy(model),
            pad_id=int(self.policy.pad_id),
            algo=self.algo_cfg,
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            device=str(self.policy.device),
        )
        worker = RankWorker(spec, 0, 1)
        worker.load(str(directory))
        return worker.optimizer.state_dict() if worker.optimizer.state else None

    def load_state_dict(self, ckpt: dict) -> None:
        """Continue from :meth:`state_dict`: weights and version, optimiser, skip counters, generator states."""
        self.policy.load_weights(ckpt["model"], ckpt["version"])
        if "optimizer" in ckpt:  # saved without it (trainer.save_optimizer=false): AdamW starts fresh
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.skipped_steps, self.skipped_in_a_row = ckpt.get("skipped", (0, 0))
        set_rng_state(ckpt, self.rng, self.policy.generator)


def batch_advantages(batch: Any, algo_cfg: AlgorithmConfig, who: str) -> tuple[list, list[float]]:
    """The batch's trajectories, group after group (empty groups left out), and each one's advantage from
    ``algorithm.adv_estimator`` within its group; ``who`` names the caller when the batch is empty."""
    groups = [list(g) for g in batch.groups if len(g) > 0]
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError(f"{who}: the batch holds no trajectories")
    estimate = ADV_ESTIMATORS[algo_cfg.adv_estimator]
    advs = estimate([[t.reward for t in g] for g in groups], norm_by_std=algo_cfg.norm_adv_by_std)
    return trajs, [float(a) for g in advs for a in g]


def rng_state(rng: random.Random, sampler: torch.Generator) -> dict[str, Any]:
    """The generator states a trainer's checkpoint carries: its own ``rng``, the policy's ``sampler`` and torch's."""
    return {"rng": rng.getstate(), "sampler": sampler.get_state().clone(), "torch_rng": torch.get_rng_state()}


def set_rng_state(ckpt: dict[str, Any], rng: random.Random, sampler: torch.Generator) -> None:
    """Restore what :func:`rng_state` saved into ``ckpt``."""
    rng.setstate(ckpt["rng"])
    sampler.set_state(ckpt["sampler"])
    torch.set_rng_state(ckpt["torch_rng"])


def _pad(rows: Iterable[list], device) -> torch.Tensor:
    """Right-pad ragged float rows with 0 into ``[B, T]``."""
    rows = list(rows)
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def _split(n: int, parts: int) -> list[torch.Tensor]:
    """Contiguous index chunks of ``range(n)``, ``min(parts, n)`` of them, sizes differing by at most one."""
    return [c for c in torch.arange(n).tensor_split(min(max(parts, 1), n)) if len(c)]


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


def _mean_metrics(per_mb: list[dict[str, Any]]) -> dict[str, float]:
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
