"""psrl.train: the Trainer (one path at every world size: GRPO-family steps on rank workers, warm start, publication
from the shards, checkpoints) and what builds a run's task and policy."""

from psrl.train.setup import build_task_and_policy, seed_everything, warm_start, warm_start_steps
from psrl.train.trainer import Trainer

__all__ = ["Trainer", "build_task_and_policy", "seed_everything", "warm_start", "warm_start_steps"]
