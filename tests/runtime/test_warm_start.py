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
        self.steps = None

    def warm_start(self, demos, steps):
        self.steps = steps
        return [1.0 - i / (steps + 1) for i in range(steps)]


@pytest.mark.parametrize("override, expected", [(None, 7), ("null", 7), ("0", None), ("3", 3)])
def test_warm_start_steps(override, expected):
    overrides = [] if override is None else [f"trainer.warm_start_steps={override}"]
    cfg = load_config(None, overrides)
    trainer = _Trainer()
    losses = warm_start(cfg, _Task(), trainer, log=lambda _: None)
    assert trainer.steps == expected
    assert len(losses) == (expected or 0)
