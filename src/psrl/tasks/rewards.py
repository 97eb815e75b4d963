"""Rewards of dataset tasks (``task.reward``): ``math``, ``exact``, ``regex:<pattern>``, ``module:function``.

Every reward is called the way verl calls a custom reward file,
``compute_score(data_source, solution_str, ground_truth, extra_info)``, so a verl user's reward
function works unchanged. It may be sync or async and return a number or a dict with ``score``
(and optional ``acc``, which the dynamic sampling filter reads).

A call is bounded by ``task.reward_timeout`` and never runs on the event loop: an async function is cancelled at
the deadline; a sync one runs on the task's own :class:`RewardExecutor` (``task.reward_workers`` daemon threads,
not the loop's default executor, which the trainer's step also uses and hung calls could starve) and is abandoned
there at the deadline (Python cannot kill a thread, so a function that never returns keeps one of those threads
until the run ends; once all are held, later calls time out waiting for one, visibly, instead of blocking). A call that raises or times out raises
:class:`RewardError` naming the reward and the row; the agent manager retries it
``task.reward_retries`` times and then records the trajectory with ``status: error``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import logging
import queue
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrl.errors import ConfigError
from psrl.tasks.base import RewardError

__all__ = ["RewardError", "RewardExecutor", "RewardFn", "build_reward", "load_function", "math_score", "exact_score"]


def exact_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the answer, stripped, equals the ground truth as text."""
    return float(solution_str.strip() == str(ground_truth).strip())


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when math-verify finds the answer equivalent to the ground truth (``\\boxed{..}``, LaTeX, plain numbers).

    math-verify's own signal-based timeouts only work on the main thread, so they are off here;
    ``task.reward_timeout`` bounds the call instead.
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: ours bounds the call
    gold = parse("\\boxed{" + str(ground_truth) + "}", parsing_timeout=None)
    if not gold:
        gold = parse(str(ground_truth), parsing_timeout=None)
    answer = parse(solution_str, parsing_timeout=None)
    return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None))


def _regex_score(pattern: str) -> Callable[..., float]:
    rx = re.compile(pattern)

    def regex_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
        m = rx.search(solution_str)
        if m is None:
            return 0.0
        found = m.group(1) if rx.groups else m.group(0)
        return float(found is not None and found.strip() == str(ground_truth).strip())

    return regex_score


def load_function(spec: str, key: str = "task.reward") -> Callable[..., Any]:
    """``module:function`` (importable) or ``path/to/file.py:function`` (verl's custom_reward_function.path);
    a ConfigError naming ``key`` when it cannot be loaded."""
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.exists():
                raise FileNotFoundError(f"no such file {path}")
            loader_spec = importlib.util.spec_from_file_location(f"psrl_{key.split('.')[-1]}_{path.stem}", path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"{path} cannot be loaded as a Python module")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        fn = getattr(module, fn_name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError, ValueError, TypeError) as e:
        # ValueError / TypeError: an empty or relative module name (":f", ".mod:f")
        raise ConfigError(key, f"cannot load {spec!r}: {e}", "give module:function or file.py:function") from e
    if not callable(fn):
        raise ConfigError(key, f"{spec!r} is not callable", "name a function")
    return fn


class RewardExecutor(concurrent.futures.Executor):
    """``workers`` daemon threads that run synchronous reward calls, started on first use (an executor for
    ``loop.run_in_executor``, so the virtual-time loop sees the call in flight).

    Daemon threads, unlike ``concurrent.futures.ThreadPoolExecutor``'s, are not joined when the interpreter exits,
    so a reward that never returns cannot keep the process alive after the run ends.
    """

    def __init__(self, workers: int = 4):
        self.workers = int(workers)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> concurrent.futures.Future:
        with self._lock:
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name=f"psrl-reward-{i}", daemon=True)
                    for i in range(self.workers)
                ]
                for t in self._threads:
                    t.start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, functools.partial(fn, *args, **kw)))
        return fut

    def _work(self) -> None:
        while True:
            fut, call = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue  # its caller gave up (timed out) before a thread was free
            try:
                fut.set_result(call())
            except BaseException as e:  # noqa: BLE001 -- handed to the awaiting caller
                fut.set_exception(e)


def build_reward(spec: str, timeout: float, workers: int = 4, judge: Any = None) -> RewardFn:
    """The reward of ``task.reward``, its synchronous calls on a :class:`RewardExecutor` of ``workers`` threads;
    ``judge``: the ``task.judge`` section, for ``task.reward: judge``."""
    pool = RewardExecutor(workers)
    if spec == "judge":
        from psrl.tasks.judge import JudgeReward

        if judge is None:
            raise ConfigError("task.reward", "judge needs the task.judge section", "set task.judge.url")
        return RewardFn("judge", JudgeReward(judge).__call__, timeout, pool)  # a bound coroutine function
    if spec == "math":
        return RewardFn("math", math_score, timeout, pool)
    if spec == "exact":
        return RewardFn("exact", exact_score, timeout, pool)
    if spec.startswith("regex:"):
        try:
            return RewardFn(spec, _regex_score(spec[len("regex:") :]), timeout, pool)
        except re.error as e:
            raise ConfigError("task.reward", f"bad regular expression in {spec!r}: {e}", "fix the pattern") from e
    if ":" in spec:
        return RewardFn(spec, load_function(spec), timeout, pool)
    raise ConfigError(
        "task.reward", f"unknown reward {spec!r}", "use math, exact, judge, regex:<pattern> or module:function"
    )


class RewardFn:
    """One reward function with its name and per-call timeout; ``await fn(...)`` gives the task's reward dict."""

    def __init__(self, name: str, fn: Callable[..., Any], timeout: float, executor: RewardExecutor | None = None):
        self.name, self.fn, self.timeout = name, fn, float(timeout)
        self.executor = executor if executor is not None else RewardExecutor()

    async def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any, where: str = ""
    ) -> dict[str, float]:
        """``score``, ``acc``, ``seq_reward``, ``seq_final_reward`` (plus any other numbers the function returned)."""
        kw = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        at = f" on {where}" if where else ""
        try:
            async with asyncio.timeout(self.timeout):  # not wait_for: 3.11's can drop a cancel
                if inspect.iscoroutinefunction(self.fn):
                    out = await self.fn(**kw)
                else:
                    call = functools.partial(self.fn, **kw)
                    out = await asyncio.get_running_loop().run_in_executor(self.executor, call)
        except TimeoutError:
            raise RewardError(
                f"reward {self.name} timed out after {self.timeout:g}s{at} "
                "(raise task.reward_timeout if it needs longer)"
            ) from None
        except Exception as e:
            raise RewardError(f"reward {self.name} raised{at}: {e!r}") from e
        return self.as_metrics(out, at)

    def as_metrics(self, out: Any, at: str, name: str | None = None) -> dict[str, float]:
        """A returned number or ``{"score": ...}`` dict as the reward metrics (``name``: who returned it)."""
        name = self.name if name is None else name
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(f"reward {name} returned a dict without 'score'{at}: keys {sorted(out)}")
            extra = {
                k: float(v)
                for k, v in out.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("score", "acc")
            }
            score = float(out["score"])
            acc = float(out.get("acc", score))
        elif isinstance(out, (int, float)):
            score = acc = float(out)
            extra = {}
        else:
            raise RewardError(
                f"reward {name} returned {type(out).__name__}{at}; expected a number or a dict with 'score'"
            )
        return {**extra, "score": score, "acc": acc, "seq_reward": score, "seq_final_reward": score}
