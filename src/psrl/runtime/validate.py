"""Validation: the newest published version on the task's validation set, greedy and with ``trainer.val_n`` samples.

Writes ``val/accuracy`` (greedy answers' ``acc``), ``val/reward`` (their ``score``) and
``val/pass@k`` (a prompt counts when any of its ``k = val_n`` sampled answers is correct).
Episodes run on engines, not on the driver's policy (issue #33, item 5): :class:`ValidationEngines` holds
``psrl.deployment.n_validate_instances`` engines of their own (vLLM servers with ``rollout.engine=vllm``; an ``hf``
engine over the driver's policy otherwise), on an event loop of their own, and before each validation loads the
newest published version into them, as a rollout instance would; the episodes are spread over them and scored with
:func:`~psrl.tasks.base.compute_reward`, as in training, with tool latencies off (they measure the tool, not the
policy). Every episode samples from its own stream (``trainer.seed``, the pass, the prompt's place and the sample's
index: :attr:`psrl.types.GenRequest.seed`), so a validation's numbers do not depend on how its requests were batched
or spread; the rollout engines and the policy's own generator are untouched, so validating does not change training.
``val/*`` measured on vLLM engines is vLLM's sampling, not comparable with figures measured in process.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from psrl.rollout.engines.base import turns
from psrl.tasks.base import compute_reward
from psrl.types import Engine, Sampling, WeightSource, stream_seed

__all__ = ["validate", "ValidationEngines"]

log = logging.getLogger(__name__)


class _Sampled(Engine, Protocol):
    """An engine whose sampling a validation pass sets (:class:`~psrl.rollout.engines.base.BatchingEngine`,
    :class:`~psrl.rollout.engines.vllm.VLLMEngine`)."""

    sampling: Sampling


async def _scores(
    task, engines: Sequence[_Sampled], prompts: list, k: int, seed: str, stream: int
) -> tuple[list[list[dict]], int]:
    """``k`` reward dicts per prompt (``{}`` for a failed one), and how many failed; sample ``i`` of prompt ``j``
    samples from ``stream_seed(stream, j, i)``, on engine ``(j * k + i) % len(engines)``."""
    failed = 0

    async def one(p, j: int, i: int) -> dict:
        nonlocal failed
        generate = turns(engines[(j * k + i) % len(engines)], stream_seed(stream, j, i))
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
    task, engines: Sequence[_Sampled], temperature: float, top_p: float, prompts: list, k: int, seed: str, stream: int
) -> tuple[list[list[dict]], int]:
    """:func:`_scores` with every engine sampling at ``temperature`` / ``top_p`` meanwhile."""
    kept = [e.sampling for e in engines]
    for e in engines:
        e.sampling = Sampling(temperature, top_p, frozenset(task.stop_ids))
    try:
        return await _scores(task, engines, prompts, k, seed, stream)
    finally:
        for e, s in zip(engines, kept):
            e.sampling = s


async def validate(
    task, engines: Sequence[_Sampled], prompts: list, val_n: int, temperature: float, top_p: float, seed: int = 0
) -> dict[str, float]:
    """The ``val/*`` metrics of the weights ``engines`` hold, on ``prompts``."""
    started = time.perf_counter()
    with _no_tool_latency(task):
        greedy, f1 = await _scored(task, engines, 0.0, top_p, prompts, 1, "val/greedy", stream_seed(seed, 0))
        sampled, f2 = await _scored(
            task, engines, temperature, top_p, prompts, val_n, "val/sampled", stream_seed(seed, 1)
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


class ValidationEngines:
    """The validation instances of a run: engines of their own, started on an event loop of their own (a thread:
    validation is called from a step hook, inside the coordinator's loop, and waits), each validation loading the
    newest version of ``weights`` into them first.

    Args:
        make: builds the engines (called once, on the validation loop).
        weights: the published versions (the trainer's :attr:`~psrl.train.Trainer.out`).
    """

    def __init__(self, make: Callable[[], Sequence[_Sampled]], weights: WeightSource):
        self.weights = weights
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="psrl-validate", daemon=True)
        self._thread.start()
        self.engines: list[_Sampled] = []
        self._run(self._start(make))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, make: Callable[[], Sequence[_Sampled]]) -> None:
        self.engines = list(make())
        if not self.engines:
            raise ValueError("ValidationEngines: no engine to validate on")
        for e in self.engines:
            await e.start()

    def validate(self, task, prompts: list, val_n: int, temperature: float, top_p: float, seed: int = 0) -> dict:
        """:func:`validate` on the newest published version (loaded first where an engine holds another); the
        metrics carry it as ``version``."""
        return self._run(self._validate(task, prompts, val_n, temperature, top_p, seed))

    async def _validate(self, task, prompts: list, val_n: int, temperature: float, top_p: float, seed: int) -> dict:
        newest = self.weights.latest_version()
        if newest is None:
            raise RuntimeError("validation: nothing is published yet")
        for e in self.engines:
            if e.version != newest:
                await e.update_weights(newest, self.weights)
        metrics = await validate(task, self.engines, prompts, val_n, temperature, top_p, seed)
        return {**metrics, "version": int(newest)}

    def close(self) -> None:
        """Close the engines (servers psrl started are stopped) and the loop (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            for e in self.engines:
                self._run(e.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


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
