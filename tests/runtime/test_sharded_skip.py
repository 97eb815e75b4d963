"""A step skipped in its second minibatch (issue #22: faults at N ranks): the trainer at 2 ranks does what the
one-process reference trainer does -- the first minibatch's update is undone, the weights published are
those before the batch, ``last_skip`` names the minibatch, the skip is counted -- and the next batch trains."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psrl.config import load_config
from psrl.models import build_policy
from psrl.tasks import get_task
from psrl.train import Trainer
from tests.runtime.test_train_sharded import _batch
from tests.train.reference_trainer import ReferenceTrainer


@pytest.mark.slow
def test_a_nan_in_the_second_minibatch_skips_the_step_at_two_ranks_as_in_process(tmp_path):
    cfg = load_config(
        None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "task.name=arith", "trainer.minibatches=2"]
    )
    policy = build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)
    single = ReferenceTrainer(policy.replica(seed=0), cfg.algorithm, cfg.trainer)
    single.policy.model.requires_grad_(True)
    sharded = Trainer(policy, cfg.algorithm, cfg.trainer, 2, tmp_path)
    good = _batch(single.policy, 0)
    nan = good.groups[1][0].reward * float("nan")  # the second group is the second minibatch: its advantages NaN
    bad = good._replace(groups=[good.groups[0], [dataclasses.replace(t, reward=nan) for t in good.groups[1]]])
    before = policy.export_state()
    store = sharded.out
    try:
        got, want = sharded.step(bad), single.step(bad)
        sharded.publish(1)
        assert sharded.last_skip is not None and "(minibatch 2/2)" in sharded.last_skip
        assert single.last_skip is not None and "(minibatch 2/2)" in single.last_skip
        assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-5) for k in want)
        assert got["train/skipped_steps"] == 1 and sharded.skipped_in_a_row == 1
        assert all(torch.equal(store.get(1)[1][k], v) for k, v in before.items())  # no update survived
        sharded.step(_batch(single.policy, 1))
        assert sharded.last_skip is None and sharded.skipped_in_a_row == 0
    finally:
        sharded.close()
