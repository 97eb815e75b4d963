"""The Reserve / Occupy / Consume protocol over versioned buffers (``shared/spec/staleness-protocol.md``).

Notation: ``eta`` staleness, ``T`` train version, ``B`` / ``B'`` batch size / buffer capacity,
``N`` / ``N'`` group size / members launched. Buffer ``b`` has ``R_b`` reserved and ``O_b``
occupied entries, ``E_b = B' - R_b - O_b``. Only buffers ``T .. T + eta`` can hold anything,
because a reservation made at version ``v <= T`` lands in a buffer ``<= v + eta``.

Why it is cheap: the manager keeps the **frontier** ``f``, the first buffer ``>= T`` with
``O_f < B``. Every buffer in ``[T, f)`` is full of occupied groups, so

* Reserve is admitted iff the latest buffer ``r <= v + eta`` with ``E_r > 0`` satisfies ``f <= r``;
* Occupy scans ``[f, r]`` for the earliest buffer with room;
* passive aborts are exactly the reservations sitting in ``[T, f)``, ended when ``f`` moves.

``f`` only moves forward, so each operation costs amortized O(eta + 1) plus O(1) per entry it
returns or ends, whatever the number of entries in flight.

Memory: one ``_Entry`` per in-flight group (6 slots + the list of its completed members) and one
``_Buffer`` per live version (at most ``max_staleness + 1``). Consumed and ended entries are forgotten.

A bound that changes (:meth:`StalenessManager.set_staleness`, within ``[0, max_staleness]``) applies to
reservations made after the change: an entry keeps the buffer it was reserved in, and it was reserved
within the bound in force then, so each trajectory satisfies ``consumed version - V_traj <=`` the bound
of its entry's reservation (``<= max_staleness`` always). Nothing is dropped when the bound falls.

Concurrency: every public method takes one re-entrant lock, so check-and-reserve is atomic and the
manager is safe to call from several threads. The group filter and the event callback run under
that lock (they may read the manager from the same thread; they must not block on another thread
that calls it). The asyncio API wakes waiters through one ``asyncio.Event`` per loop, set only when
a change could admit a reservation or ready buffer ``T``: no polling.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from typing import Any

from .types import (
    Batch,
    BufferState,
    CompleteResult,
    Event,
    EventKind,
    NotReadyError,
    StaleVersionError,
    Stats,
    Status,
)

__all__ = ["StalenessManager"]

_RESERVED, _OCCUPIED = 0, 1

_Row = tuple[Hashable, int, int, int, list[Any], int | None, int]
"""One entry in a snapshot, the fields :class:`~psrl.staleness.types.SnapshotEntry` names."""

_PENDING = CompleteResult(Status.PENDING)
_SURPLUS = CompleteResult(Status.SURPLUS)
_FILTERED = CompleteResult(Status.FILTERED)
_REJECTED = CompleteResult(Status.REJECTED)


class _Entry:
    """One group entry: reserved at buffer ``slot`` (or occupying it), reserve version ``version``."""

    __slots__ = ("id", "version", "slot", "state", "members", "min_version", "bound")

    def __init__(self, eid: Hashable, version: int, slot: int, bound: int):
        self.id = eid
        self.version = version
        self.slot = slot
        self.bound = bound
        self.state = _RESERVED
        self.members: list[Any] = []
        self.min_version: int | None = None


class _Buffer:
    """Counts of one version: ``reserved`` maps entry id -> entry (insertion ordered), ``groups`` occupied entries."""

    __slots__ = ("reserved", "groups")

    def __init__(self) -> None:
        self.reserved: dict[Hashable, _Entry] = {}
        self.groups: list[_Entry] = []


class StalenessManager:
    """Versioned buffers that keep every trained trajectory within ``staleness`` versions of its ``V_traj``.

    Args:
        staleness: ``eta >= 0``.
        batch_size: ``B``, groups one training step consumes.
        group_size: ``N``, trajectories per group the algorithm needs.
        redundant_batch_size: ``B' >= B`` entries per buffer (None: ``B``).
        redundant_group_size: ``N' >= N`` members launched per group (None: ``N``); informational
            for callers, the manager needs only ``N``.
        group_filter: ``callable(list[traj]) -> bool`` (True keeps), run on each complete group.
        on_event: ``callable(Event)``, one call per transition.
        train_version: initial ``T``.
        max_staleness: the ceiling :meth:`set_staleness` may raise the bound to (None: ``staleness``).
    """

    def __init__(
        self,
        staleness: int,
        batch_size: int,
        group_size: int,
        redundant_batch_size: int | None = None,
        redundant_group_size: int | None = None,
        group_filter: Callable[[list[Any]], Any] | None = None,
        on_event: Callable[[Event], Any] | None = None,
        train_version: int = 0,
        max_staleness: int | None = None,
    ):
        _require_int("staleness", staleness, 0)
        ceiling = staleness if max_staleness is None else max_staleness
        _require_int("max_staleness", ceiling, staleness, "it must be >= staleness")
        _require_int("batch_size", batch_size, 1)
        _require_int("group_size", group_size, 1)
        _require_int("train_version", train_version, 0)
        bp = batch_size if redundant_batch_size is None else redundant_batch_size
        np_ = group_size if redundant_group_size is None else redundant_group_size
        _require_int("redundant_batch_size", bp, batch_size, "it must be >= batch_size")
        _require_int("redundant_group_size", np_, group_size, "it must be >= group_size")
        self.staleness = staleness
        """The bound new reservations use (``eta``); :meth:`set_staleness` changes it."""
        self.max_staleness = ceiling
        self.batch_size = batch_size
        self.group_size = group_size
        self.redundant_batch_size = bp
        self.redundant_group_size = np_
        self.group_filter = group_filter
        self.on_event = on_event
        self._T = train_version
        self._frontier = train_version
        self._buffers: dict[int, _Buffer] = {}
        self._entries: dict[Hashable, _Entry] = {}
        self._next_id = 0
        self._aborted: list[tuple[Hashable, list[Any]]] = []
        """Passively aborted entries not yet drained: (id, the trajectories they held)."""
        self._lock = threading.RLock()
        self._events: dict[asyncio.AbstractEventLoop, tuple[asyncio.Event, int]] = {}
        self.stats = Stats(occupies_by_offset=[0] * (ceiling + 1), staleness_hist=[0] * (ceiling + 1))

    # ------------------------------------------------------------------ reading

    @property
    def train_version(self) -> int:
        """``T``: the version of the weights the trainer holds; buffer ``T`` is consumed next."""
        return self._T

    def state(self, b: int) -> BufferState:
        """State of buffer ``b`` (``ValueError`` for ``b < T``, a consumed buffer)."""
        with self._lock:
            if b < self._T:
                raise ValueError(f"buffer {b} is gone: train_version is {self._T}")
            buf = self._buffers.get(b)
            r, o = (len(buf.reserved), len(buf.groups)) if buf else (0, 0)
            empty = self.redundant_batch_size - r - o
            if o < self.batch_size:
                return BufferState.PENDING if empty > 0 else BufferState.STUCK
            return BufferState.READY_WITH_CAPACITY if empty > 0 else BufferState.READY

    def counts(self, b: int) -> tuple[int, int, int]:
        """``(R_b, O_b, E_b)`` of buffer ``b >= T``."""
        with self._lock:
            if b < self._T:
                raise ValueError(f"buffer {b} is gone: train_version is {self._T}")
            buf = self._buffers.get(b)
            r, o = (len(buf.reserved), len(buf.groups)) if buf else (0, 0)
            return r, o, self.redundant_batch_size - r - o

    def buffer_states(self) -> dict[int, BufferState]:
        """States of the live buffers ``T .. T + eta`` and any later one still holding reservations made under a
        larger bound (for progress lines and plots)."""
        with self._lock:
            last = max(self._T + self.staleness, max(self._buffers, default=self._T))
            return {b: self.state(b) for b in range(self._T, last + 1)}

    def blocking(self, b: int) -> list[Hashable]:
        """Ids of RESERVED entries whose reservation is in buffer ``b`` (what the proactive filter aborts).

        A consumed buffer (``b < T``) holds none: ``[]``.
        """
        with self._lock:
            buf = self._buffers.get(b)
            return list(buf.reserved) if buf else []

    def entry_members(self, eid: Hashable) -> list[Any]:
        """Trajectories held so far by a live (reserved or occupied) entry; ``[]`` if unknown."""
        with self._lock:
            e = self._entries.get(eid)
            return list(e.members) if e else []

    @property
    def in_flight(self) -> int:
        """Entries RESERVED right now."""
        with self._lock:
            return sum(len(buf.reserved) for buf in self._buffers.values())

    # ------------------------------------------------------------------ Reserve

    def try_reserve(self, version: int) -> Hashable | None:
        """Reserve a group entry for generation starting at ``version``; None when refused (back-pressure).

        Raises ``ValueError`` for ``version > T`` and :class:`StaleVersionError` for ``version + eta < T``.
        """
        with self._lock:
            return self._reserve_locked(version)

    def _reserve_locked(self, version: int) -> Hashable | None:
        T = self._T
        if version > T:
            raise ValueError(f"version {version} does not exist yet: train_version is {T}")
        hi = version + self.staleness
        if hi < T:
            self.stats.stale_refusals += 1
            raise StaleVersionError(
                f"version {version} + staleness {self.staleness} < train_version {T}: pull newer weights"
            )
        cap = self.redundant_batch_size
        buffers = self._buffers
        r = hi
        while r >= T:
            buf = buffers.get(r)
            if buf is None or len(buf.reserved) + len(buf.groups) < cap:
                break
            r -= 1
        if r < self._frontier:  # no empty slot, or every buffer in [T, r] is full of occupied groups
            self.stats.refusals += 1
            return None
        buf = buffers.get(r)
        if buf is None:
            buf = buffers[r] = _Buffer()
        eid = self._next_id
        self._next_id += 1
        entry = _Entry(eid, version, r, self.staleness)
        buf.reserved[eid] = entry
        self._entries[eid] = entry
        self.stats.reserves += 1
        if self.on_event is not None:
            self.on_event(Event(EventKind.RESERVE, eid, r, version, None, T))
        return eid

    def set_staleness(self, staleness: int) -> int:
        """Set the bound ``eta`` that reservations made from now on use, within ``[0, max_staleness]``; the old one.

        Atomic like every call. Entries already reserved keep their buffer (they were admitted within the
        bound in force then, which their trajectories keep satisfying); nothing is aborted or dropped when the
        bound falls. Waiters of :meth:`reserve` are woken: a raise may admit them, and a fall may make their
        version too old (:class:`StaleVersionError`).
        """
        with self._lock:
            if (
                isinstance(staleness, bool)
                or not isinstance(staleness, int)
                or not 0 <= staleness <= self.max_staleness
            ):
                raise ValueError(
                    f"staleness must be an int in [0, {self.max_staleness}] (max_staleness), got {staleness!r}"
                )
            old, self.staleness = self.staleness, staleness
            if staleness != old:
                self._notify()
            return old

    # ------------------------------------------------------------------ Complete / Occupy

    def complete(self, eid: Hashable, traj: Any, version: int) -> CompleteResult:
        """Hand in one finished member (generation done, reward computed) with its own ``V_traj``."""
        with self._lock:
            self.stats.completes += 1
            entry = self._entries.get(eid)
            if entry is None:
                self.stats.rejected += 1
                return _REJECTED
            if version < entry.version:
                raise ValueError(
                    f"trajectory version {version} is older than entry {eid!r}'s reserve version {entry.version}"
                )
            if entry.state == _OCCUPIED:
                self.stats.surplus += 1
                return _SURPLUS
            members = entry.members
            if len(members) + 1 < self.group_size:
                members.append(traj)
                if entry.min_version is None or version < entry.min_version:
                    entry.min_version = version
                return _PENDING
            return self._complete_group(entry, traj, version)

    occupy = complete
    """Occupy (``complete``): the protocol's word for the same method; a group occupies a buffer when its
    ``N``-th member is handed in."""

    def _complete_group(self, entry: _Entry, traj: Any, version: int) -> CompleteResult:
        group = entry.members + [traj]
        # The filter runs before any change, so an exception from it leaves the manager as it was.
        keep = self.group_filter is None or self.group_filter(group)
        entry.members = group
        if entry.min_version is None or version < entry.min_version:
            entry.min_version = version
        if not keep:
            self._end(entry, EventKind.FILTERED)
            self.stats.filtered += 1
            self._notify()
            return _FILTERED
        r = entry.slot
        del self._buffers[r].reserved[entry.id]
        b = self._room(r)
        if b is None:
            self._entries.pop(entry.id)
            self.stats.surplus += 1
            self._emit(EventKind.SURPLUS, entry, r)
            self._notify()
            return _SURPLUS
        buf = self._buffers.get(b)
        if buf is None:
            buf = self._buffers[b] = _Buffer()
        buf.groups.append(entry)
        entry.state = _OCCUPIED
        entry.slot = b
        self.stats.occupies += 1
        self.stats.occupies_by_offset[b - self._T] += 1
        self._emit(EventKind.OCCUPY, entry, b, r)
        if b == self._frontier and len(buf.groups) >= self.batch_size:
            self._advance_frontier()
        self._notify()
        return CompleteResult(Status.OCCUPIED, b)

    def _room(self, r: int) -> int | None:
        """Earliest buffer in ``[T, r]`` with ``O_b < B`` and ``E_b > 0``; buffers below the frontier are full."""
        B, cap = self.batch_size, self.redundant_batch_size
        buffers = self._buffers
        for b in range(self._frontier, r + 1):
            buf = buffers.get(b)
            if buf is None:
                return b
            o = len(buf.groups)
            if o < B and o + len(buf.reserved) < cap:
                return b
        return None

    def _advance_frontier(self) -> None:
        """Move ``f`` past full buffers and passively abort the reservations left below it."""
        B = self.batch_size
        buffers = self._buffers
        f = self._frontier
        while True:
            buf = buffers.get(f)
            if buf is None or len(buf.groups) < B:
                break
            for entry in list(buf.reserved.values()):
                self._end(entry, EventKind.PASSIVE_ABORT)
                self._aborted.append((entry.id, entry.members))
                self.stats.passive_aborts += 1
            f += 1
        self._frontier = f

    def _end(self, entry: _Entry, kind: EventKind) -> None:
        """End a RESERVED entry: release its reservation and forget it."""
        del self._buffers[entry.slot].reserved[entry.id]
        del self._entries[entry.id]
        self._emit(kind, entry, entry.slot)

    def _emit(self, kind: EventKind, entry: _Entry, buffer: int, reserved_buffer: int | None = None) -> None:
        if self.on_event is not None:
            self.on_event(Event(kind, entry.id, buffer, entry.version, entry.min_version, self._T, reserved_buffer))

    # ------------------------------------------------------------------ Abort

    def abort(self, eid: Hashable) -> bool:
        """Give up a RESERVED entry; ``False`` if unknown or ended; ``ValueError`` if OCCUPIED."""
        with self._lock:
            entry = self._entries.get(eid)
            if entry is None:
                return False
            if entry.state == _OCCUPIED:
                raise ValueError(f"entry {eid!r} is occupied in buffer {entry.slot}: it cannot be aborted")
            self._end(entry, EventKind.ABORT)
            self.stats.aborts += 1
            self._notify()
            return True

    def drain_aborted(self) -> list[Hashable]:
        """Ids of entries the manager passively aborted since the last call; cancel their generations."""
        return [eid for eid, _ in self.drain_aborted_groups()]

    def drain_aborted_groups(self) -> list[tuple[Hashable, list[Any]]]:
        """:meth:`drain_aborted` with what each entry held: ``(id, trajectories)`` (the same queue: use one)."""
        with self._lock:
            out, self._aborted = self._aborted, []
            return out

    def entry_buffer(self, eid: Hashable) -> int | None:
        """The buffer an OCCUPIED entry waits in; None for a RESERVED, ended or unknown entry."""
        with self._lock:
            e = self._entries.get(eid)
            return e.slot if e is not None and e.state == _OCCUPIED else None

    # ------------------------------------------------------------------ Consume

    def ready(self) -> bool:
        """True when buffer ``T`` holds ``B`` occupied groups, i.e. ``consume()`` would succeed."""
        with self._lock:
            buf = self._buffers.get(self._T)
            return buf is not None and len(buf.groups) >= self.batch_size

    def consume(self) -> Batch:
        """Take the ``B`` groups of buffer ``T`` and advance ``T``; :class:`NotReadyError` otherwise."""
        with self._lock:
            T = self._T
            buf = self._buffers.get(T)
            if buf is None or len(buf.groups) < self.batch_size:
                have = 0 if buf is None else len(buf.groups)
                raise NotReadyError(f"buffer {T} holds {have} of {self.batch_size} groups")
            # Reservations in buffer T were passively aborted when the frontier passed it.
            del self._buffers[T]
            self._T = T + 1
            entries = self._entries
            hist = self.stats.staleness_hist
            groups: list[list[Any]] = []
            ids: list[Hashable] = []
            versions: list[int] = []
            for entry in buf.groups:
                version = entry.min_version
                assert version is not None, "an occupied entry holds group_size >= 1 members"
                del entries[entry.id]
                groups.append(entry.members)
                ids.append(entry.id)
                versions.append(version)
                hist[T - version] += 1
                self._emit(EventKind.CONSUME, entry, T)
            self.stats.consumes += 1
            self._notify()
            return Batch(T, groups, ids, versions)

    # ------------------------------------------------------------------ asyncio

    async def reserve(self, version: int) -> Hashable:
        """Wait until a reservation at ``version`` is admitted; :class:`StaleVersionError` if it gets too old."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                eid = self._reserve_locked(version)
                if eid is not None:
                    return eid
                event = self._event(loop)
            await event.wait()

    async def next_batch(self) -> Batch:
        """Wait until buffer ``T`` is READY (or READY_WITH_CAPACITY), then consume it."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                buf = self._buffers.get(self._T)
                if buf is not None and len(buf.groups) >= self.batch_size:
                    return self.consume()
                event = self._event(loop)
            await event.wait()

    def _event(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        held = self._events.get(loop)
        if held is None:
            held = self._events[loop] = (asyncio.Event(), threading.get_ident())
        return held[0]

    def _notify(self) -> None:
        """Wake every waiter once; new waiters get a fresh event, so none misses a later change."""
        if not self._events:
            return
        events, self._events = self._events, {}
        me = threading.get_ident()
        for loop, (event, thread) in events.items():
            if thread == me:
                event.set()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    # ------------------------------------------------------------------ snapshot / restore

    def snapshot(self) -> dict[str, Any]:
        """Picklable state (no callables). Trajectories are included as given, so they must pickle too.

        ``snap["buffers"]`` maps each live buffer to ``(reserved, occupied)``, two lists of entry tuples
        whose fields :class:`~psrl.staleness.types.SnapshotEntry` names; ``snap["train_version"]`` is ``T``.
        """
        with self._lock:

            def dump(e: _Entry) -> _Row:
                return (e.id, e.version, e.slot, e.state, list(e.members), e.min_version, e.bound)

            return {
                "format": 2,
                "staleness": self.staleness,
                "max_staleness": self.max_staleness,
                "batch_size": self.batch_size,
                "group_size": self.group_size,
                "redundant_batch_size": self.redundant_batch_size,
                "redundant_group_size": self.redundant_group_size,
                "train_version": self._T,
                "frontier": self._frontier,
                "next_id": self._next_id,
                "aborted": list(self._aborted),
                "buffers": {
                    b: ([dump(e) for e in buf.reserved.values()], [dump(e) for e in buf.groups])
                    for b, buf in self._buffers.items()
                },
                "stats": self.stats.as_dict(),
            }

    @classmethod
    def restore(
        cls,
        snap: dict[str, Any],
        group_filter: Callable[[list[Any]], Any] | None = None,
        on_event: Callable[[Event], Any] | None = None,
    ) -> StalenessManager:
        """Rebuild a manager that continues exactly where the snapshotted one was.

        Format 1 (before the bound could change: no ``max_staleness``, entries without their bound) restores
        with the snapshot's ``staleness`` as every entry's bound and as the ceiling.
        """
        fmt = snap.get("format")
        if fmt not in (1, 2):
            raise ValueError(f"unknown snapshot format {fmt!r}")
        m = cls(
            snap["staleness"],
            snap["batch_size"],
            snap["group_size"],
            snap["redundant_batch_size"],
            snap["redundant_group_size"],
            group_filter=group_filter,
            on_event=on_event,
            train_version=snap["train_version"],
            max_staleness=snap.get("max_staleness", snap["staleness"]),
        )
        m._frontier = snap["frontier"]
        m._next_id = snap["next_id"]
        m._aborted = list(snap["aborted"])
        for b, (reserved, groups) in snap["buffers"].items():
            buf = m._buffers[b] = _Buffer()
            for rows, target in ((reserved, None), (groups, buf.groups)):
                for row in rows:
                    eid, version, slot, state, members, min_version = row[:6]
                    e = _Entry(eid, version, slot, row[6] if fmt == 2 else snap["staleness"])
                    e.state, e.members, e.min_version = state, list(members), min_version
                    m._entries[eid] = e
                    if target is None:
                        buf.reserved[eid] = e
                    else:
                        target.append(e)
        stats = dict(snap["stats"])
        m.stats = Stats(**stats)
        return m


def _require_int(name: str, value: Any, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}" + (f" ({why})" if why else ""))
