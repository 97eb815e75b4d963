"""Build the runtime objects of a config: seeds, task, policy (shared by the sync loop and the coordinator)."""

from __future__ import annotations

import random

import numpy as np
import torch

from psrl.models import build_policy, load_tokenizer
from psrl.tasks import get_task

__all__ = ["seed_everything", "build_task_and_policy"]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (the global generators; the policy has its own)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_task_and_policy(cfg):
    """``(task, policy)`` for ``cfg``: the model's tokenizer (if ``model.path``) is handed to the task
    first, so the task can add its marker tokens before the model's embeddings are sized."""
    tok = load_tokenizer(cfg.model)
    task = get_task(cfg.task, seed=cfg.trainer.seed, tokenizer=tok, data=getattr(cfg, "data", None))
    policy = build_policy(cfg.model, task, seed=cfg.trainer.seed)
    return task, policy
