"""How the agent manager calls a task's reward: awaited within ``task.reward_timeout``, checked finite.

A reward that hangs (an awaitable reward still running after ``task.reward_timeout`` seconds) or returns a NaN /
infinite score raises here, so the manager retries and reports it like a reward function that raised.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Coroutine
from typing import TypeVar

from psrl.tasks.base import Episode, Prompt, Task

__all__ = ["RewardTimeout", "NonFiniteReward", "finite_reward", "TaskReward", "run_to_end"]

_T = TypeVar("_T")


class RewardTimeout(Exception):
    """A reward that did not return within ``task.reward_timeout`` (it is cancelled, then retried)."""


class NonFiniteReward(ValueError):
    """A reward whose score is NaN or infinite: training on it would poison the advantages."""


def finite_reward(reward: dict) -> dict:
    """``reward`` itself, or NonFiniteReward when its ``score`` is NaN or infinite."""
    score = reward["score"]
    if not math.isfinite(float(score)):
        raise NonFiniteReward(f"reward score is {float(score)!r} (not finite)")
    return reward


class TaskReward:
    """``task.reward`` (sync or async) as one awaitable call that raises on a hang or a non-finite score.

    Args:
        task: the task whose ``reward(prompt, episode)`` is called.
        timeout: seconds an awaitable reward may take (``task.reward_timeout``); None = unbounded. A synchronous
            reward runs on the event loop and cannot be interrupted: dataset rewards run in a thread for this.
    """

    def __init__(self, task: Task, timeout: float | None):
        self.task = task
        self.timeout = timeout

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.task.reward)

    async def __call__(self, prompt: Prompt, episode: Episode) -> dict:
        out = self.task.reward(prompt, episode)
        if inspect.isawaitable(out):
            out = await self._bounded(out)
        return finite_reward(out)

    async def _bounded(self, awaitable) -> dict:
        """``awaitable`` within the timeout; a hang becomes a RewardTimeout (a failure)."""
        if self.timeout is None:
            return await awaitable
        try:
            async with asyncio.timeout(self.timeout):  # not wait_for: 3.11's can drop a cancel
                return await awaitable
        except TimeoutError:
            raise RewardTimeout(f"no reward within task.reward_timeout={self.timeout:g}s") from None


def run_to_end(run: Coroutine[object, None, _T], what: str) -> _T:
    """The result of a coroutine that never suspends, run to its end here; RuntimeError if it suspends."""
    try:
        run.send(None)
    except StopIteration as done:
        return done.value
    run.close()
    raise RuntimeError(f"{what} suspended (it is asynchronous)")
