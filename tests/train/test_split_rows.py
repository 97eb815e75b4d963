"""A trajectory of several training sequences (an agent episode split under ``task.agent_history: split``)
reaches the trainer as one row per sequence, each with the trajectory's advantage; the group's advantages are
over its trajectories, however many rows each has."""

from __future__ import annotations

import pytest
import torch

from psrl.algo.losses import policy_loss
from psrl.config import AlgorithmConfig, ModelConfig, TaskConfig, TrainerConfig
from psrl.models import build_policy
from psrl.rollout.fakes import random_batch
from psrl.staleness import Batch
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.train.steps import batch_advantages
from psrl.types import TokenSequence, Trajectory


def _split(t: Trajectory, donors: list[Trajectory]) -> Trajectory:
    """``t`` with ``donors``' tokens as its earlier sequences (same uid, reward and ``V_traj``)."""
    t.earlier = tuple(
        TokenSequence(d.prompt_ids, d.response_ids, [-0.5] * len(d.response_ids), d.loss_mask, d.token_versions)
        for d in donors
    )
    return t


@pytest.mark.parametrize("n_earlier", [0, 1, 3])
def test_rows_carry_their_trajectorys_advantage_and_the_group_counts_trajectories(n_earlier):
    task = get_task(TaskConfig(name="arith"), seed=0)
    plain = random_batch(task, groups=2, n=3, seed=3)
    split = random_batch(task, groups=2, n=3, seed=3)
    donors = random_batch(task, groups=1, n=3, seed=9).groups[0][:n_earlier]
    _split(split.groups[0][1], donors)
    trajs, adv = batch_advantages(plain, AlgorithmConfig(), "test")
    rows, row_adv = batch_advantages(split, AlgorithmConfig(), "test")
    assert len(trajs) == 6 and len(rows) == 6 + n_earlier
    expected = adv[:1] + adv[1:2] * (n_earlier + 1) + adv[2:]  # the split one's rows: earlier first, then its own
    assert row_adv == expected
    own = rows[1 + n_earlier]
    assert [r.response_ids for r in rows[1 : 2 + n_earlier]] == [d.response_ids for d in donors] + [own.response_ids]
    assert all(r.uid == own.uid and r.earlier == () for r in rows[1 : 2 + n_earlier])


def test_a_step_on_a_split_trajectory_trains_each_sequence_as_a_row():
    """The batched step's loss == policy_loss on rows built by hand: the split trajectory's two sequences as two
    rows (their own tokens, masks and behaviour log-probs) sharing its advantage."""
    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=0)
    batch = random_batch(task, seed=1)
    donor = random_batch(task, groups=1, n=1, seed=2).groups[0][0]
    _split(batch.groups[1][2], [donor])
    adv = []
    for g in batch.groups:  # GRPO over the trajectories, by hand
        r = [t.reward for t in g]
        mu = sum(r) / len(r)
        sd = (sum((x - mu) ** 2 for x in r) / len(r)) ** 0.5
        adv.append([(x - mu) / (sd + 1e-6) for x in r])
    rows, row_adv = [], []
    for g, a in zip(batch.groups, adv):
        for t, x in zip(g, a):
            for s in [*t.earlier, t]:
                rows.append((s.prompt_ids, s.response_ids, s.logprobs))
                row_adv.append(x)
    assert len(rows) == 10
    width = max(len(r[1]) for r in rows)
    logp, mask, behav = torch.zeros(len(rows), width), torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    with torch.no_grad():
        for i, (p, r, lp) in enumerate(rows):
            logp[i, : len(r)] = policy.sequence_logprobs([p], [r])[0]
            mask[i, : len(r)] = 1.0
            behav[i, : len(r)] = torch.tensor(lp)
    ref, _ = policy_loss(logp, logp, behav, torch.tensor(row_adv), mask, AlgorithmConfig())
    metrics = Trainer(policy, AlgorithmConfig(), TrainerConfig()).step(Batch(0, batch.groups, [], []))
    assert metrics["train/loss"] == pytest.approx(float(ref), abs=1e-5)
    assert metrics["train/adv_abs_mean"] == pytest.approx(sum(abs(a) for a in row_adv) / len(row_adv), rel=1e-5)


def test_a_trajectory_pickled_before_sequences_existed_is_one_row():
    """A checkpoint's held trajectories pickled without ``earlier`` (older runs) resume as one sequence each."""
    import pickle

    t = Trajectory("u", "g", 0, [1], [2, 3], [-1.0, -1.0], [1, 1])
    del t.__dict__["earlier"]  # as an instance pickled before the field existed
    old = pickle.loads(pickle.dumps(t))
    assert old.rows() == [old] and old.segment_versions == []
