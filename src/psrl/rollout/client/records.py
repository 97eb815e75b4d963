"""Bookkeeping of the rollout side: worker slots, counters, per-trajectory records and the agent manager's
groups (a reserved entry and its members).

Every trajectory that reaches the staleness manager ends in exactly one record with a
``status`` (``trained``, ``skipped``, ``surplus``, ``filtered``, ``rejected``, ``aborted``,
``error``, ``held``), so nothing is ever lost silently: a test can account for every trajectory from
``trajectories.jsonl`` alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from psrl.metrics import checked
from psrl.types import Trajectory

if TYPE_CHECKING:
    from psrl.rollout.serving.session import Session
    from psrl.tasks.base import Prompt

__all__ = ["WorkerSlots", "Counts", "trajectory_record", "MemorySink", "Member", "Group"]


class WorkerSlots:
    """Agent workers: how many trajectories may be generated at once.

    The dispatcher takes ``N'`` slots *before* it reserves a group entry, so a reservation
    never waits in a queue while its staleness window runs out.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"WorkerSlots capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.free = int(capacity)
        self._freed = asyncio.Event()

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` slots are free and take them."""
        if n > self.capacity:
            raise ValueError(f"a group needs {n} workers but only {self.capacity} exist")
        while self.free < n:
            self._freed.clear()
            await self._freed.wait()
        self.free -= n

    def release(self, n: int = 1) -> None:
        self.free += n
        if self.free > self.capacity:
            raise RuntimeError(f"released more worker slots than taken ({self.free} > {self.capacity})")
        self._freed.set()


@dataclass
class Counts:
    """Cumulative counters (``counts/<name>`` in ``metrics.jsonl``)."""

    groups: int = 0
    """Group entries reserved and launched."""
    generated: int = 0
    """Trajectories handed to the staleness manager (``complete``)."""
    trained: int = 0
    """Trajectories in consumed batches the trainer trained on."""
    skipped: int = 0
    """Trajectories in consumed batches whose step was skipped (NaN / infinite loss or gradient)."""
    cancelled: int = 0
    """In-flight trajectories cancelled (their engine work stopped): surplus members, aborted entries, retries."""
    aborted: int = 0
    """Group entries ended by an abort (failure) or a passive abort (redundancy)."""
    filtered: int = 0
    """Trajectories of groups the group filter dropped."""
    surplus: int = 0
    """Trajectories the manager did not store as surplus."""
    rejected: int = 0
    """Trajectories the manager rejected (their entry had ended)."""
    retried: int = 0
    """Trajectories re-dispatched by the proactive ``retry`` filter."""
    truncated: int = 0
    """Trajectories force-completed by the proactive ``truncate`` filter."""
    failed: int = 0
    """Trajectories whose episode or reward still raised after ``task.reward_retries`` retries (reported)."""
    error_retries: int = 0
    """Retries of a raising episode or reward function."""

    def as_metrics(self) -> dict[str, int]:
        return {f"counts/{k}": v for k, v in asdict(self).items()}


def trajectory_record(traj: Trajectory, status: str, consumed_version: int | None = None, **extra: object) -> dict:
    """One ``trajectories.jsonl`` line for a :class:`psrl.types.Trajectory`: ``response_ids`` are its last training
    sequence's; one with several (split under ``task.agent_history: split``) also says how many (``sequences``)
    and holds the others' in ``earlier_response_ids``, oldest first."""
    rec: dict[str, object] = {
        "uid": traj.uid,
        "group": traj.group,
        "v_traj": int(traj.v_traj),
        "segment_versions": list(traj.segment_versions),
        "instances": list(traj.instances),
        "status": str(status),
        "reward": float(traj.reward),
        "truncated": bool(traj.truncated),
        "gen_seconds": round(float(traj.gen_seconds), 6),
        "response_len": len(traj.response_ids),
        "response_ids": list(traj.response_ids),
    }
    if traj.earlier:
        rec["sequences"] = 1 + len(traj.earlier)
        rec["earlier_response_ids"] = [list(s.response_ids) for s in traj.earlier]
    if consumed_version is not None:
        rec["consumed_version"] = int(consumed_version)
    rec.update(extra)
    return rec


class MemorySink:
    """Collects records in lists (tests, benchmarks); :class:`psrl.runtime.recorder.RunRecorder` writes files."""

    def __init__(self) -> None:
        self.trajectories: list[dict] = []
        self.metrics: list[dict] = []

    def trajectory(self, rec: dict) -> None:
        self.trajectories.append(rec)

    def metric(self, row: dict) -> None:
        """One row, once :func:`psrl.metrics.checked` says every key is in the metric table (as the recorder)."""
        self.metrics.append(checked(row))


@dataclass(eq=False, slots=True)
class Member:
    """One launched trajectory of a group (one agent worker)."""

    idx: int
    uid: str
    task: asyncio.Task | None = None
    session: Session | None = None
    started: float = 0.0
    cancelled: bool = False
    done: bool = False
    keep_slot: bool = False

    def cancel(self) -> None:
        """Stop it: marked cancelled (filters and remedies pass it by), its task cancelled."""
        self.cancelled = True
        if self.task is not None:  # set by the manager's _launch, before anything can reach the member
            self.task.cancel()


@dataclass(eq=False, slots=True)
class Group:
    """A reserved group entry and the members generating for it. What the entry holds (its completed
    trajectories) and whether it occupies a buffer is the staleness manager's: ``entry_members``,
    ``entry_buffer``, ``drain_aborted_groups``."""

    eid: Hashable
    uid: str
    prompt: Prompt
    version: int
    seed: int | None = None
    """The group's stream seed (``trainer.seed`` and the group's number); member ``i`` samples from
    ``stream_seed(seed, i)`` (:class:`psrl.rollout.serving.session.Session`)."""
    members: dict[int, Member] = field(default_factory=dict)
    next_idx: int = 0
    proactive: bool = False

    def live(self) -> list[Member]:
        """Members still generating (not finished, not being cancelled), in launch order."""
        return [m for m in self.members.values() if not m.done and not m.cancelled]
