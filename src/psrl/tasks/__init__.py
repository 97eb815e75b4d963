"""psrl.tasks: verifiable tasks (single-turn ``arith``, agentic ``tool_arith``) behind one interface."""

from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt, Segment, Task, episode_to_trajectory, lognormal_latency
from psrl.tasks.registry import TASKS, get_task, register_task

__all__ = [
    "Task",
    "Prompt",
    "Segment",
    "Episode",
    "Demo",
    "GenerateFn",
    "episode_to_trajectory",
    "lognormal_latency",
    "get_task",
    "register_task",
    "TASKS",
]
