"""The seams between the rooms of the rollout side, as Protocols, and the status it reports.

What the sessions and the agent manager use of the pool (:class:`Pool`), what the pool uses of a router
(:class:`Router`) and of whoever builds its instances (:class:`InstanceFactory`), what an instance asks its sync
strategy (:class:`SyncStrategy`), what a sync strategy reads of the staleness manager
(:class:`VersionProvider`), and what the proactive filter reads of the trainer loop (:class:`TrainerIdle`).
The engine seam and the weight source cross layers: :mod:`psrl.types`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from psrl.rollout.serving.instance import InstanceRequest, RolloutInstance
    from psrl.types import Engine

__all__ = [
    "VersionProvider",
    "TrainerWaiting",
    "TrainerIdle",
    "SyncStrategy",
    "Router",
    "InstanceFactory",
    "Pool",
    "InstanceStatus",
    "InFlight",
    "RolloutStatus",
]


class VersionProvider(Protocol):
    """Where the trainer is: :class:`psrl.staleness.StalenessManager` (``T``)."""

    @property
    def train_version(self) -> int:
        """The version the next consumed batch trains (``T``)."""

    @property
    def staleness(self) -> int:
        """The bound new reservations use (``psrl.staleness``, or the adaptive controller's within it)."""


class TrainerWaiting(NamedTuple):
    """The trainer is idle, waiting for buffer ``buffer`` (``T``) since loop time ``since``."""

    buffer: int
    since: float


class TrainerIdle(Protocol):
    """What the proactive filter's head scope reads of the trainer loop
    (:class:`psrl.runtime.coordinator.TrainerWait`): which buffer the trainer waits on, and since when."""

    def waiting(self) -> TrainerWaiting | None:
        """The buffer the trainer waits for and since when; None while it trains (or before it starts)."""


class SyncStrategy(Protocol):
    """When an instance pulls new weights (:mod:`psrl.rollout.serving.sync`)."""

    def should_pull(self, inst: RolloutInstance, latest: int) -> bool:
        """Whether ``inst`` loads ``latest`` (newer than its version) now."""


class Router(Protocol):
    """Which instance a trajectory goes to (:mod:`psrl.rollout.serving.router`)."""

    def pick(self, candidates: Sequence[RolloutInstance], n_instances: int) -> RolloutInstance:
        """One of ``candidates`` (eligible, best first); ``n_instances`` is the size of the whole pool."""


class InstanceFactory(Protocol):
    """Builds the pool's instance ``index`` over ``engine``, wired to the pool's two listeners."""

    def __call__(
        self,
        index: int,
        engine: Engine,
        *,
        on_version: Callable[[RolloutInstance], None],
        on_round: Callable[[RolloutInstance], None],
    ) -> RolloutInstance:
        """A :class:`~psrl.rollout.serving.instance.RolloutInstance` with the run's weights, sync and settings."""


class Pool(Protocol):
    """What the agent manager and its sessions use of the instances (:class:`psrl.rollout.InstancePool`)."""

    trajectory_sticky: bool
    """Later turns of a trajectory stay on its instance."""

    def route(self, v_min: int, group: Hashable | None = None, avoid: RolloutInstance | None = None) -> RolloutInstance:
        """An instance holding a version ``>= v_min`` for a trajectory of ``group`` (not ``avoid`` if another
        will do)."""

    def landed(self, req: InstanceRequest) -> None:
        """A request migration moved has been submitted again (or given up)."""

    def min_version(self) -> int:
        """The oldest live instance version: a group reserved at it may run anywhere."""

    async def wait_version_above(self, version: int) -> None:
        """Return once every instance holds a version ``> version``."""


@dataclass(frozen=True)
class InstanceStatus:
    """One rollout instance now."""

    index: int
    version: int
    dead: bool
    syncing: bool
    active: int
    """Requests in its engine."""
    queued: int
    """Requests waiting at it."""


@dataclass(frozen=True)
class InFlight:
    """One trajectory being generated now."""

    trajectory: str
    entry: str
    """Its group's entry in the staleness manager."""
    instance: int
    """The instance its session is bound to (-1: none yet)."""
    age_s: float
    """Seconds since it started."""
    in_model_turn: bool
    """Waiting on a request at an instance (else on a tool call or its reward)."""


@dataclass(frozen=True)
class RolloutStatus:
    """What the rollout side is doing now: what the stall watchdog reports."""

    instances: list[InstanceStatus]
    in_flight: list[InFlight]
