"""When an instance pulls new weights, and when requests move (``psrl.sync_and_mig_strategy``).

**Sync** answers ``should_pull(instance, latest_version)``:

* ``greedy``: as soon as a newer version exists (freshest data, more interruptions).
* ``status_based``: when the instance's ``sync.indicator`` is below ``sync.threshold``:
  ``request_num`` (requests in flight at it: generating or waiting there), ``throughput`` (its engine's tokens/s) or ``kv_cache``
  (its engine's KV use) -- a low point, where a pull disturbs little.

Both hold back while ``check_req_before_sync`` sees requests waiting at the instance, and while the
newest version is ``<= seamless_train_version``. Neither ever holds back an instance too old to be
reserved at (``version + staleness < train_version``): it could only idle, so it pulls at once.

**Migration** (load balancing, :class:`Migration`): when ``max / min`` of ``mig.indicator`` across
the live instances exceeds ``mig.threshold``, requests on the most loaded instance are interrupted
(tokens kept, ``V_traj`` kept) and re-routed away from it, one at a time, until ``max / min`` of
``mig.stop_indicator`` -- counting the moves planned so far -- is at most ``mig.stop_threshold``, or a
further move would overshoot. The pool asks for a plan only in rounds where no sync fired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from psrl.errors import ConfigError

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.rollout.serving.instance import RolloutInstance
    from psrl.rollout.types import VersionProvider

__all__ = ["GreedySync", "StatusBasedSync", "Migration", "indicator", "build_sync", "build_migration"]


def indicator(inst: RolloutInstance, name: str) -> float:
    """An instance's status: ``request_num`` (requests in flight at it), ``throughput`` (tokens/s) or ``kv_cache``."""
    if name == "request_num":
        return float(inst.in_flight)
    ld = inst.load()
    if name == "throughput":
        return float(ld.tokens_per_s)
    if name == "kv_cache":
        return float(ld.kv_usage or 0.0)
    raise ValueError(f"unknown indicator {name!r}")


class _Sync:
    """What every sync strategy shares: check_req_before_sync, seamless_train_version, the stale escape."""

    def __init__(
        self,
        versions: VersionProvider | None = None,
        check_req_before_sync: bool = False,
        seamless_train_version: int = 0,
    ):
        self.versions = versions
        """Where the trainer is (``train_version``, and ``staleness``, the bound in force: the staleness manager);
        None: never too stale."""
        self.check_req = bool(check_req_before_sync)
        self.seamless = int(seamless_train_version)

    def should_pull(self, inst: RolloutInstance, latest: int) -> bool:
        v = self.versions
        if v is not None and inst.version + v.staleness < v.train_version:  # too stale to be reserved at
            return True
        if latest <= self.seamless:
            return False
        if self.check_req and inst.queued > 0:
            return False
        return self.ready(inst)

    def ready(self, inst: RolloutInstance) -> bool:
        raise NotImplementedError


class GreedySync(_Sync):
    """Pull the newest weights as soon as they are published."""

    def ready(self, inst: RolloutInstance) -> bool:
        return True


class StatusBasedSync(_Sync):
    """Pull when the instance's ``indicator`` is below ``threshold``."""

    def __init__(
        self,
        indicator_name: str,
        threshold: float,
        versions: VersionProvider | None = None,
        check_req_before_sync: bool = False,
        seamless_train_version: int = 0,
    ):
        super().__init__(versions, check_req_before_sync, seamless_train_version)
        self.indicator = indicator_name
        self.threshold = float(threshold)

    def ready(self, inst: RolloutInstance) -> bool:
        return indicator(inst, self.indicator) < self.threshold


def build_sync(cfg: Config, versions: VersionProvider) -> _Sync:
    """The sync strategy ``psrl.sync_and_mig_strategy`` names (``versions``: the staleness manager)."""
    sm = cfg.psrl.sync_and_mig_strategy
    check, seamless = sm.sync.check_req_before_sync, sm.sync.seamless_train_version
    if sm.method == "greedy":
        return GreedySync(versions, check, seamless)
    if sm.method == "status_based":
        threshold = _required(sm.sync.threshold, "sync.threshold", "method is status_based", "e.g. 2 for request_num")
        return StatusBasedSync(sm.sync.indicator, threshold, versions, check, seamless)
    raise ConfigError(
        "psrl.sync_and_mig_strategy.method", f"unknown sync strategy {sm.method!r}", "use greedy or status_based"
    )


def _ratio(values: Sequence[float]) -> float:
    hi, lo = max(values), min(values)
    if hi <= 0:
        return 1.0
    return hi / lo if lo > 0 else float("inf")


class Migration:
    """Plans which requests leave the most loaded instance (see the module docstring)."""

    def __init__(self, indicator_name: str, threshold: float, stop_indicator: str, stop_threshold: float | None):
        self.indicator = indicator_name
        self.threshold = float(threshold)
        self.stop_indicator = stop_indicator
        self.stop_threshold = float(threshold if stop_threshold is None else stop_threshold)

    def plan(self, instances: Sequence[RolloutInstance]) -> tuple[RolloutInstance | None, int]:
        """``(source instance, requests to move off it)``; ``(None, 0)`` when the load is balanced enough."""
        if len(instances) < 2:
            return None, 0
        start = [indicator(i, self.indicator) for i in instances]
        if _ratio(start) <= self.threshold:
            return None, 0
        src = max(range(len(instances)), key=lambda k: start[k])
        n_src = instances[src].in_flight
        if n_src <= 0:
            return None, 0
        stop = [indicator(i, self.stop_indicator) for i in instances]
        per = stop[src] / n_src  # the stop measure one request of the source carries
        moves = 0
        while moves < n_src and _ratio(stop) > self.stop_threshold:
            dst = min(range(len(stop)), key=lambda k: stop[k])
            if stop[src] - per < stop[dst] + per:  # moving one more would turn the imbalance around
                break
            stop[src] -= per
            stop[dst] += per
            moves += 1
        return instances[src], moves


def build_migration(cfg: Config) -> Migration | None:
    """``psrl.sync_and_mig_strategy.mig`` as a :class:`Migration`, or None when it is off."""
    m = cfg.psrl.sync_and_mig_strategy.mig
    if not m.enable:
        return None
    threshold = _required(
        m.threshold, "mig.threshold", "mig.enable is true", "the max/min ratio that starts one, e.g. 2.0"
    )
    return Migration(m.indicator, threshold, m.stop_indicator, m.stop_threshold)


def _required(value: float | None, key: str, because: str, example: str) -> float:
    """A threshold that ``Config.validate()`` requires here, checked again for a config built without it."""
    if value is None:
        raise ConfigError(f"psrl.sync_and_mig_strategy.{key}", f"is null but {because}", f"set it: {example}")
    return value
