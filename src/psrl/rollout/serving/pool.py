"""The rollout instances as one pool: routing, stickiness, migration, version waits, start/stop.

The pool is what the agent manager talks to: ``min_version()`` is the version it reserves at
(every instance is at least that new, so any member of the group may run anywhere),
``route(v_min, group)`` picks an instance for a trajectory with ``V_traj >= v_min``, and
``wait_version_above(v)`` parks the dispatcher when the staleness manager says ``v`` is too old.

Routing (``psrl.routing_strategy``): candidates are the live instances holding a version
``>= v_min``, not mid-sync (unless all are), with room (fewer than ``capacity`` trajectories, unless
none has), sorted by ``candidate_sort_indicator``. With group stickiness a group's later members go
where its first one went while that instance is a candidate; otherwise the router picks.

The pool builds its instances, one per engine, and is their listener: ``on_version`` (an instance loaded
weights: the version waits re-check) and ``on_round``. Migration: each instance reports every round of its loop
in which it did not pull (``on_round``); the pool asks the :class:`~psrl.rollout.serving.sync.Migration` plan only
when no instance is syncing or wants to -- sync is considered first, migration only when no sync fired.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from psrl.rollout.serving.instance import InstanceRequest, RolloutInstance
from psrl.rollout.types import InstanceStatus
from psrl.types import Engine

if TYPE_CHECKING:
    from psrl.rollout.serving.sync import Migration
    from psrl.rollout.types import InstanceFactory, Router

__all__ = ["InstancePool"]

_HOMES = 4096
"""Groups whose instance the pool remembers for group stickiness (older ones are forgotten)."""


class InstancePool:
    """Rollout instances plus the router that spreads trajectories over them.

    Args:
        engines: one engine per rollout instance.
        new_instance: ``new_instance(index, engine, on_version=..., on_round=...)`` builds one instance
            (:class:`~psrl.rollout.serving.instance.RolloutInstance` with the run's weights, sync strategy and
            settings: :func:`psrl.rollout.build_rollout`).
        router: ``pick(candidates, n_instances)`` (:mod:`psrl.rollout.serving.router`).
        capacity: trajectories an instance takes while another has room (None: no cap).
        candidate_sort: ``version`` (newest first) | ``reserve_capability`` (most room first).
        group_sticky: later members of a group go to the instance of its first member.
        trajectory_sticky: read by the sessions: later turns stay on the trajectory's instance.
        migration: a :class:`~psrl.rollout.serving.sync.Migration`, or None.
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        new_instance: InstanceFactory,
        router: Router,
        *,
        capacity: int | None = None,
        candidate_sort: str = "version",
        group_sticky: bool = False,
        trajectory_sticky: bool = True,
        migration: Migration | None = None,
    ):
        if not engines:
            raise ValueError("InstancePool needs at least one rollout instance")
        self.router = router
        self.capacity = capacity
        self.candidate_sort = candidate_sort
        self.group_sticky = bool(group_sticky)
        self.trajectory_sticky = bool(trajectory_sticky)
        self.migration = migration
        self._homes: OrderedDict[Hashable, RolloutInstance] = OrderedDict()
        self._transit: set[int] = set()
        """Requests migration interrupted whose sessions have not re-submitted them yet (no plan meanwhile:
        the loads it would read are about to change)."""
        self._changed = asyncio.Event()
        self._loops: list[asyncio.Task] = []
        self.instances = [
            new_instance(i, engine, on_version=self._on_version, on_round=self._on_round)
            for i, engine in enumerate(engines)
        ]

    def alive(self) -> list[RolloutInstance]:
        """Instances not given up on; a run with none left cannot continue."""
        alive = [inst for inst in self.instances if not getattr(inst, "dead", False)]
        if not alive:
            from psrl.errors import RunError

            raise RunError(
                "rollout.max_restarts",
                f"every rollout instance is dead ({len(self.instances)} instances, "
                "each restarted up to rollout.max_restarts times)",
                "see the engine messages above; fix the engines, or raise rollout.max_restarts",
            )
        return alive

    def min_version(self) -> int:
        """The oldest live instance version (every live instance can serve a group reserved at it)."""
        return min(inst.version for inst in self.alive())

    def versions(self) -> list[int]:
        return [inst.version for inst in self.instances]

    def candidates(self, v_min: int, avoid: RolloutInstance | None = None) -> list[RolloutInstance]:
        """The instances a request of ``V_traj >= v_min`` may go to, best first (see the module docstring)."""
        eligible = [inst for inst in self.alive() if inst.version >= v_min]
        if not eligible:
            raise ValueError(f"no rollout instance holds version >= {v_min} (versions {self.versions()})")
        eligible = [inst for inst in eligible if inst is not avoid] or eligible
        ready = [inst for inst in eligible if not inst.syncing] or eligible
        if self.capacity is not None:
            ready = [inst for inst in ready if inst.running < self.capacity] or ready
        if self.candidate_sort == "reserve_capability":
            return sorted(ready, key=lambda inst: (inst.running, inst.index))
        return sorted(ready, key=lambda inst: (-inst.version, inst.index))

    def route(self, v_min: int, group: Hashable | None = None, avoid: RolloutInstance | None = None) -> RolloutInstance:
        """An instance with version ``>= v_min`` for a trajectory (of ``group``), not ``avoid`` if another will do."""
        cands = self.candidates(v_min, avoid)
        if self.group_sticky and group is not None:
            home = self._homes.get(group)
            if home is not None and home in cands:
                return home
        inst = self.router.pick(cands, len(self.instances))
        if self.group_sticky and group is not None and group not in self._homes:
            self._homes[group] = inst
            if len(self._homes) > _HOMES:
                self._homes.popitem(last=False)
        return inst

    async def wait_version_above(self, version: int) -> None:
        """Return once every instance holds a version ``> version``."""
        while self.min_version() <= version:
            self._changed.clear()
            await self._changed.wait()

    def notify_published(self) -> None:
        """A new version was published: every instance re-checks its sync strategy."""
        for inst in self.instances:
            inst.wake()

    def _on_version(self, _inst: RolloutInstance) -> None:
        self._changed.set()

    def _on_round(self, _inst: RolloutInstance) -> None:
        """An instance finished a round without pulling: balance the load unless a sync is due anywhere."""
        if self.migration is None:
            return
        alive = [inst for inst in self.instances if not inst.dead]
        if self._transit or any(inst.syncing or inst.wants_pull() for inst in alive):
            return
        src, n = self.migration.plan(alive)
        if src is not None and n > 0:
            self._transit.update(id(req) for req in src.migrate(n))

    def landed(self, req: InstanceRequest) -> None:
        """A migrated request's session has re-submitted it elsewhere (or given it up)."""
        self._transit.discard(id(req))

    def start(self) -> None:
        self._loops = [inst.start() for inst in self.instances]

    async def ready(self) -> None:
        """Return once every instance's engine is started and holds the newest published version; an instance
        whose loop ends first (its engine cannot start) raises its error here."""
        ready = asyncio.gather(*(inst.ready.wait() for inst in self.instances))
        done, _ = await asyncio.wait([ready, *self._loops], return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            for fut in done:
                fut.result()  # raises the engine's start-up error
            raise RuntimeError("a rollout instance stopped before its engine was ready")

    async def stop(self) -> None:
        for inst in self.instances:
            await inst.stop()

    def status(self) -> list[InstanceStatus]:
        """Every instance now (the stall watchdog's report)."""
        return [InstanceStatus(i.index, i.version, i.dead, i.syncing, i.active, i.queued) for i in self.instances]

    def stats(self) -> dict[str, float]:
        """Engine counters summed over instances (for metrics)."""
        keys = ("steps", "tokens", "loads", "interrupted", "continued", "migrated")
        out = {f"rollout/{k}": float(sum(getattr(i, k) for i in self.instances)) for k in keys}
        out["engine/failed_requests"] = float(sum(i.failed for i in self.instances))
        out["engine/restarts"] = float(sum(i.restarts for i in self.instances))
        out["engine/dead"] = float(sum(i.dead for i in self.instances))
        out["engine/rejoins"] = float(sum(i.rejoins for i in self.instances))
        loads = [i.load() for i in self.instances]
        out["engine/tokens_per_s"] = float(sum(ld.tokens_per_s for ld in loads))
        out["engine/running"] = float(sum(ld.running for ld in loads))
        out["engine/queued"] = float(sum(ld.queued for ld in loads))
        kv = [ld.kv_usage for ld in loads if ld.kv_usage is not None]
        if kv:
            out["engine/kv_usage"] = sum(kv) / len(kv)
        return out
