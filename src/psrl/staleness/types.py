"""Value types of the staleness core: states, statuses, results, events, errors, counters.

Standard library only. Every type here is plain data (picklable), so snapshots and events
can cross processes.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "BufferState",
    "Status",
    "CompleteResult",
    "Batch",
    "Event",
    "EventKind",
    "SnapshotEntry",
    "Stats",
    "StaleVersionError",
    "NotReadyError",
]


class StaleVersionError(Exception):
    """``reserve(v)`` with ``v + staleness < train_version``: the rollout weights are too old.

    The rollout side must pull newer weights and reserve again at the new version.
    """


class NotReadyError(Exception):
    """``consume()`` while buffer ``train_version`` does not hold ``batch_size`` occupied groups."""


class BufferState(str, enum.Enum):
    """State of one versioned buffer (the spec's table; compares equal to the plain string)."""

    PENDING = "PENDING"
    """``O_b < B`` and ``E_b > 0``: accepts reservations, not trainable yet."""
    STUCK = "STUCK"
    """``O_b < B`` and ``E_b == 0``: full of reservations; waits on in-flight work."""
    READY = "READY"
    """``O_b == B`` and ``E_b == 0``: trainable."""
    READY_WITH_CAPACITY = "READY_WITH_CAPACITY"
    """``O_b == B`` and ``E_b > 0``: trainable, room left (only when ``B' > B``)."""

    def __str__(self) -> str:  # so f"{state}" prints PENDING, not BufferState.PENDING
        return self.value


class Status(str, enum.Enum):
    """Outcome of ``complete()`` (compares equal to the plain string)."""

    PENDING = "pending"
    """Kept; the group still waits for members."""
    OCCUPIED = "occupied"
    """The N-th member arrived; the group occupies ``CompleteResult.buffer``."""
    SURPLUS = "surplus"
    """Not stored: the group is already occupied (an ``N' > N`` extra), or no buffer had room."""
    FILTERED = "filtered"
    """The group filter rejected the complete group; the entry ended."""
    REJECTED = "rejected"
    """Not stored: the entry is unknown, aborted, filtered, dropped or already consumed."""

    def __str__(self) -> str:
        return self.value


class CompleteResult(NamedTuple):
    """What ``complete()`` returns: the status and, for ``occupied``, the buffer version."""

    status: Status
    buffer: int | None = None


class Batch(NamedTuple):
    """A consumed buffer: ``version`` is the train version it was consumed at (the old ``T``).

    ``groups`` holds ``B`` lists, each the ``N`` trajectories of one group in completion order;
    groups are in occupy order. ``entries`` and ``group_versions`` are parallel to ``groups``
    (the group version is the minimum member ``V_traj``).
    """

    version: int
    groups: list[list[Any]]
    entries: list[Hashable]
    group_versions: list[int]


class EventKind(str, enum.Enum):
    """What an :class:`Event` did to its entry (compares equal to the plain string, which is what
    ``events.jsonl`` holds)."""

    RESERVE = "reserve"
    """EMPTY -> RESERVED at ``buffer``."""
    OCCUPY = "occupy"
    """RESERVED -> OCCUPIED at ``buffer``; ``reserved_buffer`` is where it had been reserved."""
    FILTERED = "filtered"
    """The group filter rejected the complete group; its reservation at ``buffer`` is released."""
    SURPLUS = "surplus"
    """The group completed but no buffer had room; its reservation at ``buffer`` is released."""
    ABORT = "abort"
    """The caller gave the entry up (``abort``); its reservation at ``buffer`` is released."""
    PASSIVE_ABORT = "passive_abort"
    """The manager ended the entry (it could never land); its reservation at ``buffer`` is released."""
    CONSUME = "consume"
    """OCCUPIED -> EMPTY: buffer ``buffer`` was consumed (one event per entry)."""

    def __str__(self) -> str:
        return self.value


class Event(NamedTuple):
    """One transition, passed to the optional ``on_event`` callback.

    ``kind`` says which (:class:`EventKind`). ``version`` is the entry's reserve version, ``group_version``
    the minimum member ``V_traj`` (None until members arrive), ``train_version`` the manager's ``T`` after
    the transition.
    """

    kind: EventKind
    entry: Hashable
    buffer: int
    version: int
    group_version: int | None
    train_version: int
    reserved_buffer: int | None = None


class SnapshotEntry(NamedTuple):
    """The fields of one entry in a :meth:`~psrl.staleness.StalenessManager.snapshot`, in order.

    ``snap["buffers"]`` maps each live buffer ``b`` to ``(reserved, occupied)``, two lists of entry tuples
    (occupied ones in occupy order); ``SnapshotEntry._make(row)`` reads one by name. The rows themselves stay
    plain tuples, so a pickled snapshot (a checkpoint) does not depend on this class.
    """

    id: Hashable
    """The entry id ``try_reserve`` returned."""
    version: int
    """The reserve version."""
    buffer: int
    """The buffer it is reserved in (RESERVED) or occupies (OCCUPIED)."""
    state: int
    """0 RESERVED, 1 OCCUPIED."""
    members: list[Any]
    """The trajectories it holds so far, in completion order."""
    min_version: int | None
    """The minimum member ``V_traj`` (None before the first member)."""
    bound: int
    """The staleness bound in force when it was reserved (its trajectories satisfy ``consumed - V_traj <= bound``)."""


@dataclass
class Stats:
    """Counters, updated in O(1) per operation; read them directly (``m.stats.reserves``).

    ``occupies_by_offset[k]`` counts groups occupied into buffer ``T + k``;
    ``staleness_hist[s]`` counts consumed groups whose ``consumed version - group version == s`` (both sized
    ``max_staleness + 1``).
    """

    reserves: int = 0
    refusals: int = 0
    stale_refusals: int = 0
    completes: int = 0
    occupies: int = 0
    surplus: int = 0
    filtered: int = 0
    rejected: int = 0
    aborts: int = 0
    passive_aborts: int = 0
    consumes: int = 0
    occupies_by_offset: list[int] = field(default_factory=list)
    staleness_hist: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A copy, safe to keep or serialize."""
        d = dict(self.__dict__)
        d["occupies_by_offset"] = list(self.occupies_by_offset)
        d["staleness_hist"] = list(self.staleness_hist)
        return d
