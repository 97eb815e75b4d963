"""A slow reference of the trainer step (habit 10 of ../shared/style.md): the in-process trainer psrl had before
issue #33 made every world size run the rank workers. Tests check :class:`psrl.train.Trainer` against it."""

from __future__ import annotations

import copy
import math
import random

import torch

from psrl.algo.corrections import batch_corrections
from psrl.algo.divergence import divergence_metrics
from psrl.algo.losses import policy_loss
from psrl.train.steps import batch_advantages, logprob_mismatch, mean_metrics, pad_rows, step_scaled


def _split(n: int, parts: int) -> list[torch.Tensor]:
    """Contiguous index chunks of ``range(n)``, ``min(parts, n)`` of them, sizes differing by at most one."""
    return [c for c in torch.arange(n).tensor_split(min(max(parts, 1), n)) if len(c)]


class ReferenceTrainer:
    """The world-size-1 trainer psrl had before issue #33 (one process, the policy's own ``sequence_logprobs``,
    ``policy_loss`` per minibatch): the slow, obvious twin :class:`psrl.train.Trainer` is checked against."""

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
        trajs, flat_adv = batch_advantages(batch, self.algo_cfg, "ReferenceTrainer.step")
        dev = self.policy.device
        adv = torch.tensor(flat_adv, dtype=torch.float32, device=dev)
        prompts = [t.prompt_ids for t in trajs]
        responses = [t.response_ids for t in trajs]
        mask = pad_rows([t.loss_mask for t in trajs], dev)
        behav = pad_rows([t.logprobs for t in trajs], dev)
        temp = self.cfg.temperature
        with torch.no_grad():
            old = self.policy.sequence_logprobs(prompts, responses, temp)
        mismatch = logprob_mismatch(
            old, behav, mask, pad_rows([t.token_versions for t in trajs], dev), self.policy.version
        )
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
        per_mb = []
        for k, idx in enumerate(chunks):
            logp = self.policy.sequence_logprobs([prompts[i] for i in idx], [responses[i] for i in idx], temp)
            width = logp.shape[1]
            loss, m = policy_loss(
                logp, old[idx, :width], behav[idx, :width], adv[idx], mask[idx, :width], self.algo_cfg
            )
            where = f" (minibatch {k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            if not math.isfinite(float(loss.detach())):
                return self._skip(f"loss is {float(loss.detach())!r}{where}", before, divergence)
            norm = self._optimise(loss, lr_scale)
            if norm is None:
                return self._skip(f"gradient norm is not finite{where}", before, divergence)
            m["train/grad_norm"] = norm
            m["train/loss"] = float(loss.detach())
            per_mb.append(m)
        self.skipped_in_a_row = 0
        return {
            **mean_metrics(per_mb),
            **mismatch,
            **divergence,
            **corrections,
            "train/adv_abs_mean": float(adv.abs().mean()),
            "train/skipped_steps": self.skipped_steps,
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
