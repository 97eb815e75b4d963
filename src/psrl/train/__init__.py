"""psrl.train: the Trainer (GRPO-family steps, warm start, checkpoints) and the versioned ParameterStore."""

from psrl.train.setup import build_task_and_policy, seed_everything, warm_start
from psrl.train.store import ParameterStore
from psrl.train.trainer import Trainer

__all__ = ["Trainer", "ParameterStore", "build_task_and_policy", "seed_everything", "warm_start"]
