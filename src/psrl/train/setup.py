"""Build the runtime objects of a config: seeds, task, policy, and the supervised warm start of the trainer."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from psrl.errors import ConfigError, PsrlError, RunError, describe
from psrl.models import build_policy, load_tokenizer
from psrl.tasks import get_task
from psrl.train.lora import check_targets, lora_spec

__all__ = ["seed_everything", "build_task_and_policy", "warm_start", "warm_start_steps"]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (the global generators; the policy has its own)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_task_and_policy(cfg, weights: Callable[[Any], bool] | None = None):
    """``(task, policy)`` for ``cfg``: the model's tokenizer (if ``model.path``) is handed to the task
    first, so the task can add its marker tokens before the model's embeddings are sized. ``weights(task)``
    False: the policy is built without weights (:attr:`psrl.models.Policy.weightless`; default: with)."""
    m = cfg.model
    where = f"model.path={m.path}" + (f" model.gguf_file={m.gguf_file}" if m.gguf_file else "")
    fix = "check the directory holds a complete model that transformers can load offline"
    try:
        tok = load_tokenizer(m)
    except PsrlError:
        raise
    except Exception as e:  # files that exist (checked at load) but do not load: damaged, unsupported
        raise RunError(where, f"cannot load the tokenizer: {describe(e)}", fix) from e
    try:
        task = get_task(cfg.task, seed=cfg.trainer.seed, tokenizer=tok, data=getattr(cfg, "data", None))
    except PsrlError:
        raise
    except Exception as e:  # a task class rejecting its task.kwargs values, or failing to read its data
        raise RunError(
            f"task.name={cfg.task.name}",
            f"the task could not be built: {describe(e)}",
            "check task.kwargs and the task's data files",
        ) from e
    turn = getattr(task, "turn_tokens", None)
    if turn is not None and int(turn) > cfg.trainer.max_new_tokens:
        raise ConfigError(
            "trainer.max_new_tokens",
            f"is {cfg.trainer.max_new_tokens}, below task {cfg.task.name}'s turn length {turn}",
            f"set trainer.max_new_tokens={turn} or more",
        )
    try:
        policy = build_policy(m, task, seed=cfg.trainer.seed, weights=weights is None or weights(task))
    except PsrlError:
        raise
    except Exception as e:
        what = where if m.path is not None else f"built-in model (model.n_layer={m.n_layer}, n_embd={m.n_embd})"
        raise RunError(what, f"cannot build the model: {describe(e)}", fix) from e
    spec = lora_spec(m)
    if spec is not None:  # a LoRA target the model does not have: a config error now, not in the ranks
        check_targets(policy.model, spec)
    return task, policy


def warm_start(cfg: Any, task: Any, trainer: Any, log: Callable[[str], None] = print) -> list[float]:
    """Supervised warm start on the task's demos (``trainer.warm_start_steps``; null = the task's default, 0 = none)."""
    steps = warm_start_steps(cfg, task)
    if steps <= 0:
        return []
    demos = task.demonstrations(max(256, 4 * steps), random.Random(f"{cfg.trainer.seed}/demos"))
    losses = trainer.warm_start(demos, steps, batch_size=cfg.trainer.warm_start_batch)
    log(f"warm start: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def warm_start_steps(cfg: Any, task: Any) -> int:
    """The supervised warm start's steps: ``trainer.warm_start_steps``, or (null) the task's default."""
    steps = cfg.trainer.warm_start_steps
    return int(getattr(task, "warm_start_steps", 0) if steps is None else steps)
