"""Rewards of dataset tasks (``task.reward``): ``math``, ``exact``, ``regex:<pattern>``, ``module:function``.

Every reward is called the way verl calls a custom reward file,
``compute_score(data_source, solution_str, ground_truth, extra_info)``, so a verl user's reward
function works unchanged. It may be sync or async and return a number or a dict with ``score``
(and optional ``acc``, which the dynamic sampling filter reads).

A call is bounded by ``task.reward_timeout``: an async function is cancelled at the deadline; a
sync one runs in a worker thread and is abandoned there (Python cannot kill a thread, so a
function that never returns keeps one thread busy). A call that raises or times out raises
:class:`RewardError` naming the reward and the row; the agent manager retries it
``task.reward_retries`` times and then records the trajectory with ``status: error``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrl.errors import ConfigError

__all__ = ["RewardError", "RewardFn", "build_reward", "math_score", "exact_score"]


class RewardError(RuntimeError):
    """A reward call raised, timed out or returned something that is not a score."""


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


def _load_function(spec: str) -> Callable[..., Any]:
    """``module:function`` (importable) or ``path/to/file.py:function`` (verl's custom_reward_function.path)."""
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.exists():
                raise FileNotFoundError(f"no such file {path}")
            loader_spec = importlib.util.spec_from_file_location(f"psrl_reward_{path.stem}", path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"{path} cannot be loaded as a Python module")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        fn = getattr(module, fn_name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as e:
        raise ConfigError(
            "task.reward", f"cannot load {spec!r}: {e}", "give module:function or file.py:function"
        ) from e
    if not callable(fn):
        raise ConfigError("task.reward", f"{spec!r} is not callable", "name a function")
    return fn


def build_reward(spec: str, timeout: float) -> RewardFn:
    """The reward of ``task.reward``."""
    if spec == "math":
        return RewardFn("math", math_score, timeout)
    if spec == "exact":
        return RewardFn("exact", exact_score, timeout)
    if spec.startswith("regex:"):
        try:
            return RewardFn(spec, _regex_score(spec[len("regex:") :]), timeout)
        except re.error as e:
            raise ConfigError("task.reward", f"bad regular expression in {spec!r}: {e}", "fix the pattern") from e
    if ":" in spec:
        return RewardFn(spec, _load_function(spec), timeout)
    raise ConfigError("task.reward", f"unknown reward {spec!r}", "use math, exact, regex:<pattern> or module:function")


class RewardFn:
    """One reward function with its name and per-call timeout; ``await fn(...)`` gives the task's reward dict."""

    def __init__(self, name: str, fn: Callable[..., Any], timeout: float):
        self.name, self.fn, self.timeout = name, fn, float(timeout)

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
            if inspect.iscoroutinefunction(self.fn):
                out = await asyncio.wait_for(self.fn(**kw), self.timeout)
            else:
                out = await asyncio.wait_for(asyncio.to_thread(self.fn, **kw), self.timeout)
        except TimeoutError:
            raise RewardError(
                f"reward {self.name} timed out after {self.timeout:g}s{at} "
                "(raise task.reward_timeout if it needs longer)"
            ) from None
        except Exception as e:
            raise RewardError(f"reward {self.name} raised{at}: {e!r}") from e
        return self._as_metrics(out, at)

    def _as_metrics(self, out: Any, at: str) -> dict[str, float]:
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(f"reward {self.name} returned a dict without 'score'{at}: keys {sorted(out)}")
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
                f"reward {self.name} returned {type(out).__name__}{at}; expected a number or a dict with 'score'"
            )
        return {**extra, "score": score, "acc": acc, "seq_reward": score, "seq_final_reward": score}
