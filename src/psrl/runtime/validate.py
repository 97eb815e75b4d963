"""Validation: the current weights on the task's validation set, greedy and with ``trainer.val_n`` samples.

Writes ``val/accuracy`` (greedy answers' ``acc``), ``val/reward`` (their ``score``) and
``val/pass@k`` (a prompt counts when any of its ``k = val_n`` sampled answers is correct).
Episodes run batched through the rollout engine of ``rollout.engine: hf``
(:class:`~psrl.rollout.engines.hf.HFEngine`, over the trainer's own weights) and
:func:`~psrl.tasks.base.compute_reward`, as in training, with tool latencies off (they measure the
tool, not the policy). Every episode samples from its own stream (``trainer.seed``, the pass, the prompt's
place and the sample's index: :attr:`psrl.types.GenRequest.seed`), so a validation's numbers do not depend on
how its requests were batched; the policy's own generator is untouched, so validating does not change training.

A reward that raises during validation scores 0 and is counted in ``val/failed``: validation
reports, it does not stop a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from psrl.rollout.engines.base import turns
from psrl.rollout.engines.hf import HFEngine
from psrl.tasks.base import compute_reward
from psrl.types import Sampling, stream_seed

__all__ = ["validate", "validate_blocking"]

log = logging.getLogger(__name__)


async def _scores(
    task, engine: HFEngine, prompts: list, k: int, seed: str, stream: int
) -> tuple[list[list[dict]], int]:
    """``k`` reward dicts per prompt (``{}`` for a failed one), and how many failed; sample ``i`` of prompt ``j``
    samples from ``stream_seed(stream, j, i)``."""
    failed = 0

    async def one(p, j: int, i: int) -> dict:
        nonlocal failed
        generate = turns(engine, stream_seed(stream, j, i))
        ep = await task.run_episode(p, generate, random.Random(f"{seed}/{p.uid}/{i}"))
        try:
            return await compute_reward(task, p, ep)
        except Exception as e:
            failed += 1
            log.warning("validation reward failed on %s: %r", p.uid, e)
            return {}

    flat = await asyncio.gather(*[one(p, j, i) for j, p in enumerate(prompts) for i in range(k)])
    return [list(flat[j * k : (j + 1) * k]) for j in range(len(prompts))], failed


async def _scored(
    task, policy, temperature: float, top_p: float, prompts: list, k: int, seed: str, stream: int
) -> tuple[list[list[dict]], int]:
    engine = HFEngine(policy, sampling=Sampling(temperature, top_p, frozenset(task.stop_ids)))
    try:
        return await _scores(task, engine, prompts, k, seed, stream)
    finally:
        await engine.close()


async def validate(
    task, policy, prompts: list, val_n: int, temperature: float, top_p: float, seed: int = 0
) -> dict[str, float]:
    """The ``val/*`` metrics of ``policy`` on ``prompts``."""
    started = time.perf_counter()
    with _no_tool_latency(task):
        greedy, f1 = await _scored(task, policy, 0.0, top_p, prompts, 1, "val/greedy", stream_seed(seed, 0))
        sampled, f2 = await _scored(
            task, policy, temperature, top_p, prompts, val_n, "val/sampled", stream_seed(seed, 1)
        )
    n = max(len(prompts), 1)
    return {
        "val/accuracy": sum(g[0].get("acc", g[0].get("score", 0.0)) for g in greedy) / n,
        "val/reward": sum(g[0].get("score", 0.0) for g in greedy) / n,
        "val/pass@k": sum(any(r.get("acc", r.get("score", 0.0)) > 0 for r in s) for s in sampled) / n,
        "val/k": float(val_n),
        "val/prompts": float(len(prompts)),
        "val/failed": float(f1 + f2),
        "val/seconds": time.perf_counter() - started,
    }


def validate_blocking(*args: Any, **kwargs: Any) -> dict[str, float]:
    """:func:`validate` from synchronous code that may sit inside a running event loop (a step hook):
    it runs on its own loop in a worker thread while the caller waits, so the run is paused meanwhile."""
    out: dict = {}

    def target() -> None:
        try:
            out["metrics"] = asyncio.run(validate(*args, **kwargs))
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=target, name="psrl-validate")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["metrics"]


@contextlib.contextmanager
def _no_tool_latency(task) -> Iterator[None]:
    """Agentic tasks: tool latency 0 while validating (the run is paused, so swapping ``task.cfg`` is safe)."""
    cfg = getattr(task, "cfg", None)
    if cfg is None or not hasattr(cfg, "tool_latency_median"):
        yield
        return
    task.cfg = dataclasses.replace(cfg, tool_latency_median=0.0)
    try:
        yield
    finally:
        task.cfg = cfg
