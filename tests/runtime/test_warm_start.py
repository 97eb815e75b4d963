"""``trainer.warm_start_steps``: null runs the task's default, 0 skips the warm start, N runs N steps."""

from __future__ import annotations

import pytest

from psrl.config import load_config
from psrl.train import warm_start


class _Task:
    warm_start_steps = 7

    def demonstrations(self, n, rng):
        return [("prompt", "answer")] * n


class _Trainer:
    def __init__(self):
        self.steps = self.batch_size = None

    def warm_start(self, demos, steps, batch_size=32):
        self.steps, self.batch_size = steps, batch_size
        return [1.0 - i / (steps + 1) for i in range(steps)]


@pytest.mark.parametrize("override, expected", [(None, 7), ("null", 7), ("0", None), ("3", 3)])
def test_warm_start_steps(override, expected):
    overrides = [] if override is None else [f"trainer.warm_start_steps={override}"]
    cfg = load_config(None, overrides)
    trainer = _Trainer()
    losses = warm_start(cfg, _Task(), trainer, log=lambda _: None)
    assert trainer.steps == expected
    assert len(losses) == (expected or 0)


def test_warm_start_batch_is_the_configs():
    """``trainer.warm_start_batch`` is how many demonstrations each warm-start step sees."""
    trainer = _Trainer()
    warm_start(load_config(None, ["trainer.warm_start_steps=2", "trainer.warm_start_batch=5"]), _Task(), trainer)
    assert (trainer.steps, trainer.batch_size) == (2, 5)
