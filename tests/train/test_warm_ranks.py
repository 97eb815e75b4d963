"""The supervised warm start on the ranks (issue #33, item 5; :mod:`psrl.train.warm`): where the driver holds no
weights, two ranks warm-start their shards and end where one process warm-starting the driver's policy ends (the
same demonstrations per step, drawn by the driver; the same loss per step), and the driver still holds nothing."""

from __future__ import annotations

import random

import pytest
import torch

from psrl.config import load_config
from psrl.models import build_policy
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.train.steps import warm_start_chunks

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.device=cpu"]


def test_the_driver_draws_each_steps_demonstrations_as_one_process_does():
    """The chunks are drawn from the trainer's generator, batch by batch, as the in-driver warm start draws them."""
    a, b = random.Random(3), random.Random(3)
    chunks = warm_start_chunks(a, 10, 4, 6)
    assert chunks == [[b.randrange(10) for _ in range(6)] for _ in range(4)]
    assert warm_start_chunks(random.Random(0), 3, 2, 8) == [c[:3] for c in warm_start_chunks(random.Random(0), 3, 2, 3)]


@pytest.mark.slow  # two rank processes
def test_two_ranks_warm_start_their_shards_as_one_process_warm_starts_the_policy(tmp_path):
    cfg = load_config(None, SMALL)
    task = get_task(cfg.task, seed=0)
    demos = task.demonstrations(24, random.Random(0))
    one = Trainer(build_policy(cfg.model, task, seed=0), cfg.algorithm, cfg.trainer, 1)
    light = build_policy(cfg.model, task, seed=0, weights=False)
    two = Trainer(light, cfg.algorithm, cfg.trainer, 2, tmp_path)
    try:
        want = one.warm_start(demos, 6, batch_size=7)  # 7 rows: ranks get 4 and 3
        got = two.warm_start(demos, 6, batch_size=7)
        state = two.start().call("state")[0]
    finally:
        two.close()
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert want[-1] < want[0]  # it trained
    reference = one.policy.model.state_dict()
    diff = max(float((torch.from_numpy(state[k]) - v).abs().max()) for k, v in reference.items())
    assert diff < 1e-5
    start = build_policy(cfg.model, task, seed=0).model.state_dict()
    assert any(not torch.equal(torch.from_numpy(state[k]), start[k]) for k in start)
    assert light.weightless and all(p.is_meta for p in light.model.parameters())
