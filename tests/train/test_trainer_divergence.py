"""A real trainer step reports the batch's divergence (whole batch and per staleness level) and, only when asked,
applies M2PO's mask and VCPO's learning-rate scale; with both off its row only gains the divergence keys."""

from __future__ import annotations

import random

import pytest
import torch

from psrl.algo.advantages import group_advantages
from psrl.algo.corrections import m2po_keep
from psrl.algo.divergence import divergence_metrics, token_log_ratio
from psrl.algo.losses import policy_loss
from psrl.config import AlgorithmConfig, ModelConfig, RolloutCorrectionConfig, TaskConfig, TrainerConfig
from psrl.metrics import known
from psrl.models import build_policy
from psrl.staleness import Batch
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.types import Trajectory

ROW_BEFORE = {  # the keys a step returned before the divergence metrics (issue 23)
    "actor/approx_kl",
    "actor/clip_frac_high",
    "actor/clip_frac_low",
    "actor/ratio_mean",
    "loss/policy",
    "correction/is_truncated_frac",
    "correction/is_weight_max",
    "correction/is_weight_mean",
    "correction/rho_mean",
    "correction/rs_masked_frac",
    "engine/logprob_mismatch_mean",
    "engine/logprob_mismatch_max",
    "engine/mismatch_tokens",
    "train/grad_norm",
    "train/loss",
    "train/adv_abs_mean",
    "train/skipped_steps",
    "train/empty_minibatches",  # issue 33
}


def _policy(seed=0):
    task = get_task(TaskConfig(name="arith"), seed=0)
    return task, build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=seed)


def _batch(task, policy, version=5, lags=(0, 1, 3), n=3, seed=0, spread=0.3):
    """One group per staleness in ``lags`` (V_traj = version - lag); behaviour log-probs are the policy's own plus
    uniform noise in +-spread (a stale or mismatched sampler); one tool token (loss mask 0) per response."""
    rng = random.Random(seed)
    groups = []
    for g, lag in enumerate(lags):
        p = task.sample_prompt(rng)
        members = []
        for i in range(n):
            k = rng.randint(2, 6)
            resp = [rng.randrange(task.tokenizer.vocab_size) for _ in range(k)]
            with torch.no_grad():
                own = policy.sequence_logprobs([p.ids], [resp])[0].tolist()
            members.append(
                Trajectory(
                    uid=f"{g}/{i}",
                    group=str(g),
                    v_traj=version - lag,
                    prompt_ids=p.ids,
                    response_ids=resp,
                    logprobs=[x + rng.uniform(-spread, spread) for x in own],
                    loss_mask=[1] * (k - 1) + [0],
                    token_versions=[version - lag] * (k - 1) + [-1],
                    reward=float(rng.random() < 0.5) + 0.1 * i,
                )
            )
        groups.append(members)
    return Batch(version, groups, [], [])


def _by_hand(policy, batch):
    """``(old, behav, mask, lag)`` built one trajectory at a time."""
    trajs = [t for g in batch.groups for t in g]
    width = max(len(t.response_ids) for t in trajs)
    old, behav, mask = (torch.zeros(len(trajs), width) for _ in range(3))
    with torch.no_grad():
        for i, t in enumerate(trajs):
            row = policy.sequence_logprobs([t.prompt_ids], [t.response_ids])[0]
            old[i, : len(row)] = row
            behav[i, : len(row)] = torch.tensor(t.logprobs)
            mask[i, : len(row)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return old, behav, mask, torch.tensor([batch.version - t.v_traj for t in trajs])


def test_row_gains_only_the_divergence_keys_and_they_are_the_batchs():
    """Options off: the row is the keys it was plus divergence/{ess,m2,kl}, their @s<k> for the levels in the batch
    and staleness/tokens@s<k>; the values are those of the batch built by hand (level = version - V_traj)."""
    task, policy = _policy()
    batch = _batch(task, policy)
    expect = divergence_metrics(*_by_hand(policy, batch))
    m = Trainer(policy, AlgorithmConfig(), TrainerConfig()).step(batch)
    assert set(m) - ROW_BEFORE == set(expect) and ROW_BEFORE <= set(m)
    assert {k for k in expect if "@s" in k} == {
        f"{n}@s{s}" for s in (0, 1, 3) for n in ("divergence/ess", "divergence/m2", "divergence/kl", "staleness/tokens")
    }
    assert all(known(k) for k in m)
    for k, v in expect.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert sum(m[f"staleness/tokens@s{s}"] for s in (0, 1, 3)) == pytest.approx(1.0)


def test_m2po_masks_the_loss_tokens_before_the_minibatches():
    """m2po: the step's loss is policy_loss with the batch's M2PO mask applied to the loss mask, and the masked
    fraction is reported (the advantages and the mask are tested against references in tests/algo)."""
    task, policy = _policy()
    batch = _batch(task, policy, spread=0.6)
    old, behav, mask, _ = _by_hand(policy, batch)
    keep = m2po_keep(*token_log_ratio(old, behav, mask), 0.04).float()
    adv = torch.tensor([a for g in group_advantages([[t.reward for t in g] for g in batch.groups]) for a in g])
    algo = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(m2po=True))
    ref, _ = policy_loss(old, old, behav, adv, mask * keep, algo)
    m = Trainer(policy, algo, TrainerConfig()).step(batch)
    frac = 1 - float(keep.sum() / mask.sum())
    assert 0 < frac < 1
    assert m["correction/m2po_masked_frac"] == pytest.approx(frac)
    assert m["train/loss"] == pytest.approx(float(ref), abs=1e-5)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_ess_lr_steps_as_if_the_lr_were_scaled_for_this_step_only(minibatches):
    """ess_lr: the weights after the step equal those of a trainer whose lr is lr * correction/ess_lr_scale, and the
    optimiser's lr is back to trainer.lr afterwards."""
    task, p1 = _policy()
    _, p2 = _policy()
    batch = _batch(task, p2, spread=1.5)
    rc = RolloutCorrectionConfig(ess_lr=True, ess_lr_min=0.01)
    scaled = Trainer(p1, AlgorithmConfig(rollout_correction=rc), TrainerConfig(minibatches=minibatches))
    m = scaled.step(batch)
    scale = m["correction/ess_lr_scale"]
    assert 0.01 < scale < 1
    plain = Trainer(p2, AlgorithmConfig(), TrainerConfig(minibatches=minibatches, lr=TrainerConfig().lr * scale))
    plain.step(batch)
    for a, b in zip(p1.model.parameters(), p2.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    assert [g["lr"] for g in scaled.start().worker.optimizer.param_groups] == [TrainerConfig().lr]  # type: ignore[attr-defined]


def test_a_skipped_step_still_reports_the_divergence(monkeypatch):
    """A NaN loss skips the step; the batch's divergence is in its row (that is when it is looked for)."""
    import psrl.train.worker as worker_mod

    task, policy = _policy()
    real = worker_mod.token_loss
    monkeypatch.setattr(worker_mod, "token_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), {}))
    m = Trainer(policy, AlgorithmConfig(), TrainerConfig()).step(_batch(task, policy))
    assert m["train/skipped_steps"] == 1 and "divergence/ess" in m and "divergence/m2@s3" in m
