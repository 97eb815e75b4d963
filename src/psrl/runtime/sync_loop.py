"""The synchronous loop: generate a batch with version ``v``, train on it, publish ``v + 1``. Repeat.

Staleness is 0 by construction. Episodes of one batch run concurrently on one asyncio loop
(``asyncio.gather``) and their model turns share forward passes through a
:class:`psrl.models.batching.DecodeBatcher`. Tool latencies are scaled by
``trainer.sync_tool_latency_scale`` (default 0: no waiting, so a run repeats exactly).

This is the baseline the asynchronous coordinator is measured against, and the proof that
the policy, tasks and trainer learn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from psrl.models.batching import DecodeBatcher
from psrl.tasks.base import Prompt, compute_reward, episode_to_trajectory
from psrl.train import ParameterStore, Trainer, build_task_and_policy, seed_everything
from psrl.types import Trajectory

__all__ = ["run_sync", "SyncBatch", "rollout_groups", "warm_start"]


@dataclass
class SyncBatch:
    """What the trainer consumes: the version that generated it and its groups (as ``consume()`` returns)."""

    version: int
    groups: list[list[Trajectory]]


async def _episode(task, batcher: DecodeBatcher, prompt: Prompt, rng: random.Random, uid: str, version: int) -> Trajectory:
    ep = await task.run_episode(prompt, batcher.generate, rng)
    reward = await compute_reward(task, prompt, ep)
    return episode_to_trajectory(prompt, ep, reward, uid=uid, group=prompt.uid, v_traj=version)


async def rollout_groups(task, batcher: DecodeBatcher, prompts: list[Prompt], group_size: int, version: int,
                         seed: str) -> list[list[Trajectory]]:
    """Run ``group_size`` episodes per prompt concurrently; each episode has its own rng, seeded by
    ``(seed, group, member)``, so results do not depend on how episodes interleave."""
    coros = [
        _episode(task, batcher, p, random.Random(f"{seed}/{g}/{i}"), f"{p.uid}/{i}", version)
        for g, p in enumerate(prompts) for i in range(group_size)
    ]
    flat = await asyncio.gather(*coros)
    return [list(flat[g * group_size:(g + 1) * group_size]) for g in range(len(prompts))]


def warm_start(cfg, task, trainer: Trainer, log: Callable[[str], None] = print) -> list[float]:
    """Supervised warm start on the task's demos (``trainer.warm_start_steps``; null = the task's default, 0 = none)."""
    steps = cfg.trainer.warm_start_steps
    if steps is None:
        steps = getattr(task, "warm_start_steps", 0)
    if steps <= 0:
        return []
    demos = task.demonstrations(max(256, 4 * steps), random.Random(f"{cfg.trainer.seed}/demos"))
    losses = trainer.warm_start(demos, steps)
    log(f"warm start: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def _scaled(cfg):
    """``cfg`` with the tool latency median scaled for the synchronous loop."""
    scale = cfg.trainer.sync_tool_latency_scale
    task = dataclasses.replace(cfg.task, tool_latency_median=cfg.task.tool_latency_median * scale)
    return dataclasses.replace(cfg, task=task)


def run_sync(cfg, steps: Optional[int] = None, log: Callable[[str], None] = print) -> list[dict]:
    """Warm start, then ``steps`` (default ``trainer.total_steps``) synchronous RL steps; returns per-step metrics."""
    cfg = _scaled(cfg)
    steps = cfg.trainer.total_steps if steps is None else int(steps)
    seed = cfg.trainer.seed
    seed_everything(seed)
    task, policy = build_task_and_policy(cfg)
    store = ParameterStore(keep=2)
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer, store=store)
    warm_start(cfg, task, trainer, log)
    store.publish(policy.version, policy.export_state())
    prompt_rng = random.Random(f"{seed}/prompts")
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        version = policy.version
        prompts = [task.sample_prompt(prompt_rng) for _ in range(cfg.psrl.batch_size)]
        batcher = DecodeBatcher(policy, cfg.trainer.temperature, cfg.trainer.top_p, task.stop_ids)
        groups = asyncio.run(rollout_groups(task, batcher, prompts, cfg.psrl.group_size, version, f"{seed}/{step}"))
        t1 = time.perf_counter()
        metrics = trainer.step(SyncBatch(version, groups))
        metrics.update({"step": step, "time/rollout_s": t1 - t0, "time/train_s": time.perf_counter() - t1,
                        "rollout/forward_calls": batcher.forward_calls})
        history.append(metrics)
        log(_line(metrics))
    return history


def _line(m: dict) -> str:
    return (f"step {m['step']:3d} v={m['train/version']:3d} reward {m['reward/mean']:.3f} "
            f"len {m['batch/response_len_mean']:.1f} loss {m['train/loss']:+.4f} "
            f"gnorm {m['train/grad_norm']:.3f} clip {m.get('actor/clip_frac_high', 0.0):.3f} "
            f"({m['time/rollout_s']:.2f}s gen, {m['time/train_s']:.2f}s train)")
