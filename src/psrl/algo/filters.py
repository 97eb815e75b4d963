"""Group filters run on completed groups before they occupy a buffer slot (``group_post_process``).

A filter is any picklable ``callable(list[trajectory]) -> bool`` (True = keep): it crosses Ray
processes into the staleness manager, so it must be a module-level class, never a closure.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from psrl.errors import ConfigError

__all__ = ["DynamicSamplingFilter", "build_group_filter"]

GroupFilter = Callable[[list], bool]


class DynamicSamplingFilter:
    """DAPO dynamic sampling: drop a group whose ``metric`` has zero std across its members.

    Such a group (all right or all wrong) has zero GRPO advantage for every member, so it
    carries no gradient and would only shrink the effective batch. "Std is zero" is decided
    exactly, as "all values are equal" (identical floats can give a std of 1e-17 otherwise).
    Empty and one-member groups are dropped for the same reason. NaN values count as unequal
    to everything, so a group containing a NaN is kept (and the NaN surfaces downstream).

    Members are objects with a ``.metrics`` dict (:class:`psrl.types.Trajectory`), dicts with
    the metric as a key, or dicts with a ``"metrics"`` dict.
    """

    def __init__(self, metric: str):
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                "algorithm.filter_groups.metric",
                f"must be a metric name, got {metric!r}",
                "set it to score, acc, seq_reward or seq_final_reward",
            )
        self.metric = metric

    def __call__(self, group: Sequence[Any]) -> bool:
        values = [self._value(member) for member in group]
        if len(values) < 2:
            return False
        first = values[0]
        return any(not (v == first) for v in values[1:])

    def _value(self, member: Any) -> float:
        """The member's metric as a float; a missing metric is an error naming the metric."""
        if isinstance(member, dict):
            source = member if self.metric in member else member.get("metrics", {})
        else:
            source = getattr(member, "metrics", None)
            if source is None:
                raise TypeError(f"DynamicSamplingFilter: group member {member!r} has no .metrics dict")
        if self.metric not in source:
            raise KeyError(
                f"DynamicSamplingFilter: trajectory has no metric {self.metric!r} "
                f"(algorithm.filter_groups.metric); it has {sorted(source)}"
            )
        return float(source[self.metric])

    def __repr__(self) -> str:
        return f"DynamicSamplingFilter(metric={self.metric!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DynamicSamplingFilter) and other.metric == self.metric

    def __hash__(self) -> int:
        return hash((DynamicSamplingFilter, self.metric))


def build_group_filter(psrl_cfg: Any, algo_cfg: Any) -> GroupFilter | None:
    """The group filter ``psrl.group_post_process`` asks for, or None when it is disabled.

    ``name: dynamic_sampling_filter`` reads ``algorithm.filter_groups.metric``; ``module:callable``
    imports the object (a class is instantiated without arguments).
    """
    gpp = psrl_cfg.group_post_process
    if not gpp.enable:
        return None
    key = "psrl.group_post_process.name"
    if gpp.name is None:
        raise ConfigError(
            key,
            "is null but group_post_process.enable is true",
            "set name: dynamic_sampling_filter (or module:callable), or enable: false",
        )
    if gpp.name == "dynamic_sampling_filter":
        metric = algo_cfg.filter_groups.metric
        if metric is None:
            raise ConfigError(
                "algorithm.filter_groups.metric",
                "dynamic_sampling_filter needs a metric",
                "set it to score, acc, seq_reward or seq_final_reward",
            )
        return DynamicSamplingFilter(metric)
    if ":" not in gpp.name:
        raise ConfigError(key, f"unknown filter {gpp.name!r}", "use dynamic_sampling_filter or module:callable")
    return _import_filter(gpp.name, key)


def _import_filter(spec: str, key: str) -> GroupFilter:
    """Import ``module:attr`` (attr may be dotted); instantiate it if it is a class."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            key, f"cannot import module {module_name!r} ({e})", "give an importable module:callable"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(key, f"module {module_name!r} has no attribute {attr!r}", "check the name after ':'")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable", "point it at a function or class taking a group")
    return obj
