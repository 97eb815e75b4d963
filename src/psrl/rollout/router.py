"""Routers (which instance serves a trajectory) and sync strategies (when an instance pulls weights).

Routers only choose among *eligible* instances, those whose version is ``>= V_traj`` of the
trajectory (the pool filters them, :mod:`psrl.rollout.pool`), so routing can never make a
segment older than its trajectory.

* ``round_robin``: the next eligible instance in turn.
* ``request_num_balance``: the eligible instance with the fewest running trajectories
  (ties: the lowest index), so a slow instance does not accumulate work.

Sync strategies answer ``should_pull(instance, latest_version)``:

* ``greedy``: pull the newest version as soon as it exists (freshest data, more interruptions).
* ``request_num``: pull once fewer than ``psrl.sync_request_threshold`` trajectories run on the
  instance (few in-flight generations to disturb) -- or when the instance is too old to be
  reserved at (``version + staleness < train_version``), since then it could only idle.
"""

from __future__ import annotations

from typing import Any, Sequence

from psrl.config import ConfigError

__all__ = ["RoundRobinRouter", "RequestNumBalanceRouter", "GreedySync", "RequestNumSync", "build_router", "build_sync"]


class RoundRobinRouter:
    """Cycle through the instances; skip the ineligible ones."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Any], n_instances: int) -> Any:
        by_index = {inst.index: inst for inst in candidates}
        for k in range(n_instances):
            idx = (self._next + k) % n_instances
            if idx in by_index:
                self._next = idx + 1
                return by_index[idx]
        raise ValueError("RoundRobinRouter: no candidate instance")


class RequestNumBalanceRouter:
    """The candidate with the fewest running trajectories (lowest index on ties)."""

    name = "request_num_balance"

    def pick(self, candidates: Sequence[Any], n_instances: int) -> Any:
        if not candidates:
            raise ValueError("RequestNumBalanceRouter: no candidate instance")
        return min(candidates, key=lambda inst: (inst.running, inst.index))


class GreedySync:
    """Pull the newest weights as soon as they are published."""

    name = "greedy"

    def should_pull(self, instance: Any, latest: int) -> bool:
        return True


class RequestNumSync:
    """Pull when fewer than ``threshold`` trajectories run on the instance, or when it is too stale to use."""

    name = "request_num"

    def __init__(self, threshold: int, staleness: int, manager: Any):
        self.threshold = int(threshold)
        self.staleness = int(staleness)
        self.manager = manager
        """Anything with ``train_version`` (the staleness manager)."""

    def should_pull(self, instance: Any, latest: int) -> bool:
        if instance.running < self.threshold:
            return True
        return instance.version + self.staleness < self.manager.train_version


def build_router(name: str) -> Any:
    """The router ``psrl.router`` names."""
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "request_num_balance":
        return RequestNumBalanceRouter()
    raise ConfigError("psrl.router", f"unknown router {name!r}", "use round_robin or request_num_balance")


def build_sync(name: str, threshold: int, staleness: int, manager: Any) -> Any:
    """The sync strategy ``psrl.sync_strategy`` names (``manager`` provides ``train_version``)."""
    if name == "greedy":
        return GreedySync()
    if name == "request_num":
        return RequestNumSync(threshold, staleness, manager)
    raise ConfigError("psrl.sync_strategy", f"unknown sync strategy {name!r}", "use greedy or request_num")
