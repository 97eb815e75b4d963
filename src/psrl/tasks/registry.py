"""Tasks by name: the built-ins (``arith``, ``tool_arith``), ``dataset`` (your files), ``agent`` (your agent over
your files), ``verifiers`` (a verifiers environment) or any ``module:Class``."""

from __future__ import annotations

import inspect

from psrl.errors import ConfigError, resolve_target

__all__ = ["get_task", "register_task", "resolve_task", "TASKS"]

TASKS: dict[str, str] = {
    "arith": "psrl.tasks.arith:ArithTask",
    "tool_arith": "psrl.tasks.tool_arith:ToolArithTask",
    "dataset": "psrl.tasks.dataset:DatasetTask",
    "agent": "psrl.tasks.agent.task:AgentTask",
    "verifiers": "psrl.tasks.verifiers:VerifiersTask",
}


def register_task(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:Class"`` so configs can say ``task.name: <name>``."""
    TASKS[name] = target


def resolve_task(name: str) -> type:
    """The class ``task.name`` names (a registered name or ``module:Class``); ConfigError naming task.name."""
    target = TASKS.get(name, name)
    if ":" not in target:
        import difflib

        close = difflib.get_close_matches(name, list(TASKS), n=1)
        raise ConfigError(
            "task.name",
            f"unknown task {name!r}",
            f"use one of {', '.join(sorted(TASKS))} or "
            "module:Class" + (f" (did you mean '{close[0]}'?)" if close else ""),
        )
    return resolve_target("task.name", target, "class")


def get_task(task_cfg, seed: int = 0, tokenizer=None, data=None):
    """Build ``task.name`` with ``task.kwargs``; ``tokenizer`` is the model's own (None: the task's built-in one).

    A ``module:Class`` task is called as ``Class(task_cfg, seed=seed, tokenizer=tokenizer, **task.kwargs)``,
    plus ``data=`` (the ``data.*`` section) when its constructor takes a ``data`` argument.
    """
    cls = resolve_task(task_cfg.name)
    kw = dict(task_cfg.kwargs)
    if data is not None and "data" in inspect.signature(cls).parameters:
        kw["data"] = data
    return cls(task_cfg, seed=seed, tokenizer=tokenizer, **kw)
