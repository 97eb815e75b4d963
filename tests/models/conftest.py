"""One thread per test process: the machine has 2 cores shared by everything."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tool_task():
    """A tool_arith task and a tiny policy briefly warm-started on clean demos, so it calls the tool."""
    import random

    from psrl.config import AlgorithmConfig, ModelConfig, TaskConfig, TrainerConfig
    from psrl.models import build_policy
    from psrl.tasks import get_task
    from psrl.train import Trainer

    task = get_task(TaskConfig(name="tool_arith", kwargs={"demo_lazy_prob": 0.0, "max_value": 9}), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=0)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig())
    trainer.warm_start(task.demonstrations(256, random.Random(0)), steps=40)
    return task, policy
