"""The rollout instances as one pool: routing, version waits, start/stop.

The pool is what the agent manager talks to: ``min_version()`` is the version it reserves at
(every instance is at least that new, so any member of the group may run anywhere),
``route(v_min)`` picks an instance for a trajectory with ``V_traj >= v_min``, and
``wait_version_above(v)`` parks the dispatcher when the staleness manager says ``v`` is too old.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from psrl.rollout.instance import RolloutInstance

__all__ = ["InstancePool"]


class InstancePool:
    """Rollout instances plus the router that spreads trajectories over them."""

    def __init__(self, instances: Sequence[RolloutInstance], router: Any):
        if not instances:
            raise ValueError("InstancePool needs at least one rollout instance")
        self.instances = list(instances)
        self.router = router
        self._changed = asyncio.Event()
        for inst in self.instances:
            inst.on_version = self._on_version

    def alive(self) -> list[RolloutInstance]:
        """Instances not given up on; a run with none left cannot continue."""
        alive = [inst for inst in self.instances if not getattr(inst, "dead", False)]
        if not alive:
            from psrl.errors import RunError

            raise RunError("rollout.max_restarts", f"every rollout instance is dead ({len(self.instances)} instances, "
                           "each restarted up to rollout.max_restarts times)",
                           "see the engine messages above; fix the engines, or raise rollout.max_restarts")
        return alive

    def min_version(self) -> int:
        """The oldest live instance version (every live instance can serve a group reserved at it)."""
        return min(inst.version for inst in self.alive())

    def versions(self) -> list[int]:
        return [inst.version for inst in self.instances]

    def route(self, v_min: int) -> RolloutInstance:
        """An instance with version ``>= v_min`` for a trajectory; instances mid-sync only as a last resort."""
        eligible = [inst for inst in self.alive() if inst.version >= v_min]
        if not eligible:
            raise ValueError(f"no rollout instance holds version >= {v_min} (versions {self.versions()})")
        ready = [inst for inst in eligible if not inst.syncing] or eligible
        return self.router.pick(ready, len(self.instances))

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

    def start(self) -> None:
        for inst in self.instances:
            inst.start()

    async def ready(self) -> None:
        """Return once every instance's engine is started and holds the newest published version."""
        for inst in self.instances:
            await inst.ready.wait()

    async def stop(self) -> None:
        for inst in self.instances:
            await inst.stop()

    def stats(self) -> dict[str, float]:
        """Engine counters summed over instances (for metrics)."""
        keys = ("steps", "tokens", "loads", "interrupted", "continued")
        out = {f"rollout/{k}": float(sum(getattr(i, k) for i in self.instances)) for k in keys}
        out["engine/failed_requests"] = float(sum(i.failed for i in self.instances))
        out["engine/restarts"] = float(sum(i.restarts for i in self.instances))
        out["engine/dead"] = float(sum(i.dead for i in self.instances))
        loads = [i.load() for i in self.instances]
        out["engine/tokens_per_s"] = float(sum(ld.tokens_per_s for ld in loads))
        out["engine/running"] = float(sum(ld.running for ld in loads))
        out["engine/queued"] = float(sum(ld.queued for ld in loads))
        kv = [ld.kv_usage for ld in loads if ld.kv_usage is not None]
        if kv:
            out["engine/kv_usage"] = sum(kv) / len(kv)
        return out


def describe(pool: Optional[InstancePool]) -> str:
    """``v[3,3] run[5,4]`` -- versions and running trajectories per instance, for progress lines."""
    if pool is None:
        return ""
    vs = ",".join(str(i.version) for i in pool.instances)
    rs = ",".join(str(i.running) for i in pool.instances)
    return f"v[{vs}] run[{rs}]"
