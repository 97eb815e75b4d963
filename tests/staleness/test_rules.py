"""The spec's rules one by one, with boundaries parametrized (eta and eta+1, B'=B and B'>B, N'=N and N'>N)."""

from __future__ import annotations

import json
import pickle

import pytest

from psrl.staleness import (
    BufferState,
    EventKind,
    NotReadyError,
    SnapshotEntry,
    StalenessManager,
    StaleVersionError,
    Status,
)


def fill_group(m, eid, version, tag="t"):
    """Complete all N members of an entry; returns the last result."""
    res = None
    for i in range(m.group_size):
        res = m.complete(eid, f"{tag}{eid}-{i}", version)
    return res


def fill_buffer(m, version):
    """Reserve and complete B groups at ``version``; returns their entry ids."""
    ids = []
    for _ in range(m.batch_size):
        eid = m.try_reserve(version)
        assert eid is not None
        fill_group(m, eid, version)
        ids.append(eid)
    return ids


class TestReserve:
    @pytest.mark.parametrize("eta", [0, 1, 3])
    def test_worst_case_placement_is_v_plus_eta(self, eta):
        """A reservation lands in buffer v + eta while that buffer has an empty slot."""
        m = StalenessManager(staleness=eta, batch_size=2, group_size=1)
        eid = m.try_reserve(0)
        assert m.blocking(eta) == [eid]
        assert all(m.blocking(b) == [] for b in range(eta))

    @pytest.mark.parametrize("eta", [0, 1, 2])
    def test_staleness_boundary_eta_and_eta_plus_one(self, eta):
        """Version T - eta is still admissible; T - eta - 1 raises StaleVersionError."""
        m = StalenessManager(staleness=eta, batch_size=1, group_size=1, train_version=5)
        assert m.try_reserve(5 - eta) is not None
        with pytest.raises(StaleVersionError):
            m.try_reserve(5 - eta - 1)

    def test_future_version_is_value_error(self):
        """A version the trainer has not produced yet does not exist."""
        m = StalenessManager(staleness=1, batch_size=1, group_size=1)
        with pytest.raises(ValueError):
            m.try_reserve(1)

    def test_falls_back_to_earlier_buffer_when_latest_is_full(self):
        """When v + eta has no empty slot, the latest earlier buffer with one is used."""
        m = StalenessManager(staleness=1, batch_size=2, group_size=1)
        m.try_reserve(0), m.try_reserve(0)  # fill buffer 1 with reservations
        assert m.state(1) == BufferState.STUCK
        c = m.try_reserve(0)
        assert c in m.blocking(0)

    @pytest.mark.parametrize("extra", [0, 1])
    def test_refuses_when_every_slot_is_taken(self, extra):
        """Back-pressure: with eta=0 at most B' reservations are in flight, then refusals."""
        m = StalenessManager(staleness=0, batch_size=2, group_size=1, redundant_batch_size=2 + extra)
        ids = [m.try_reserve(0) for _ in range(2 + extra)]
        assert None not in ids
        assert m.try_reserve(0) is None
        assert m.stats.refusals == 1

    def test_refused_when_all_buffers_up_to_r_are_occupied(self):
        """B'>B: room left in buffer T but it already has B occupied groups -> refuse (would be aborted)."""
        m = StalenessManager(staleness=0, batch_size=1, group_size=1, redundant_batch_size=3)
        fill_buffer(m, 0)
        assert m.state(0) == BufferState.READY_WITH_CAPACITY
        assert m.try_reserve(0) is None


class TestOccupy:
    def test_greedy_placement_in_earliest_buffer(self):
        """A completed group leaves its worst-case slot and occupies the earliest buffer with room."""
        m = StalenessManager(staleness=2, batch_size=2, group_size=1)
        eid = m.try_reserve(0)
        res = m.complete(eid, "x", 0)
        assert res.status == Status.OCCUPIED and res.buffer == 0
        assert m.counts(2) == (0, 0, 2)

    @pytest.mark.parametrize("n,extra", [(1, 0), (2, 0), (2, 1), (3, 2)])
    def test_group_waits_for_n_members_and_extras_are_surplus(self, n, extra):
        """Pending until the N-th member; members beyond N (N'>N) are surplus until consumed, then rejected."""
        m = StalenessManager(staleness=0, batch_size=1, group_size=n, redundant_group_size=n + extra)
        eid = m.try_reserve(0)
        statuses = [m.complete(eid, i, 0).status for i in range(n + extra)]
        assert statuses == ["pending"] * (n - 1) + ["occupied"] + ["surplus"] * extra
        batch = m.consume()
        assert batch.groups == [list(range(n))]
        assert m.complete(eid, "late", 0).status == "rejected"

    def test_surplus_when_no_buffer_has_room(self):
        """Buffer T is STUCK (no empty slot) and r already holds B groups: the group is dropped as surplus."""
        m = StalenessManager(staleness=1, batch_size=1, group_size=1, redundant_batch_size=2)
        a, b = m.try_reserve(0), m.try_reserve(0)  # both in buffer 1
        c, d = m.try_reserve(0), m.try_reserve(0)  # fall back to buffer 0, which is now STUCK
        assert m.blocking(1) == [a, b] and m.blocking(0) == [c, d]
        assert m.complete(a, "a", 0) == (Status.OCCUPIED, 1)
        assert m.complete(b, "b", 0).status == Status.SURPLUS
        assert m.stats.surplus == 1 and m.counts(1) == (0, 1, 1)
        assert m.complete(b, "b-again", 0).status == Status.REJECTED

    def test_member_older_than_reserve_version_is_error(self):
        """A member is never older than its entry's reserve version."""
        m = StalenessManager(staleness=2, batch_size=1, group_size=2, train_version=3)
        eid = m.try_reserve(2)
        with pytest.raises(ValueError):
            m.complete(eid, "x", 1)
        assert m.complete(eid, "x", 3).status == "pending"  # a retried member may be newer

    def test_group_version_is_min_member_version(self):
        """The batch reports min V_traj of the members as the group version."""
        m = StalenessManager(staleness=2, batch_size=1, group_size=2, train_version=2)
        eid = m.try_reserve(1)
        m.complete(eid, "new", 2)
        m.complete(eid, "old", 1)
        assert m.consume().group_versions == [1]

    def test_unknown_entry_is_rejected(self):
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        assert m.complete("nope", "x", 0).status == Status.REJECTED


class TestFilter:
    def test_filtered_group_releases_its_slot(self):
        """A rejected group ends as filtered and its slot becomes reservable again."""
        m = StalenessManager(staleness=0, batch_size=1, group_size=2, group_filter=lambda g: False)
        eid = m.try_reserve(0)
        assert m.try_reserve(0) is None
        m.complete(eid, 1, 0)
        assert m.complete(eid, 2, 0).status == "filtered"
        assert m.complete(eid, 3, 0).status == "rejected"
        assert m.try_reserve(0) is not None
        assert m.stats.filtered == 1

    def test_filter_exception_changes_nothing(self):
        """A failing filter propagates and leaves the manager as it was (nothing lost)."""

        def boom(group):
            raise RuntimeError("filter failed")

        m = StalenessManager(staleness=0, batch_size=1, group_size=1, group_filter=boom)
        eid = m.try_reserve(0)
        with pytest.raises(RuntimeError):
            m.complete(eid, "x", 0)
        assert m.blocking(0) == [eid] and m.entry_members(eid) == []


class TestAbort:
    def test_abort_reserved_then_rejects(self):
        m = StalenessManager(staleness=0, batch_size=1, group_size=2)
        eid = m.try_reserve(0)
        m.complete(eid, "a", 0)
        assert m.abort(eid) is True
        assert m.abort(eid) is False
        assert m.complete(eid, "b", 0).status == "rejected"
        assert m.counts(0) == (0, 0, 1)

    def test_abort_occupied_is_error(self):
        m = StalenessManager(staleness=0, batch_size=2, group_size=1)
        eid = m.try_reserve(0)
        m.complete(eid, "a", 0)
        with pytest.raises(ValueError):
            m.abort(eid)

    @pytest.mark.parametrize("extra", [1, 2])
    def test_passive_abort_of_redundant_entries(self, extra):
        """B'>B: once buffer T holds B groups, the reservations left in it are ended and reported once."""
        m = StalenessManager(staleness=0, batch_size=2, group_size=1, redundant_batch_size=2 + extra)
        ids = [m.try_reserve(0) for _ in range(2 + extra)]
        m.complete(ids[0], "a", 0)
        assert m.drain_aborted() == []
        m.complete(ids[1], "b", 0)
        assert sorted(m.drain_aborted()) == sorted(ids[2:])
        assert m.drain_aborted() == []
        assert m.state(0) == BufferState.READY_WITH_CAPACITY
        assert all(m.complete(i, "late", 0).status == "rejected" for i in ids[2:])

    def test_passive_aborts_report_what_each_entry_held_and_occupied_entries_their_buffer(self):
        """drain_aborted_groups: the same queue as drain_aborted, with each ended entry's trajectories (so the
        caller records them without a copy of its own); entry_buffer: the buffer of an OCCUPIED entry only."""
        m = StalenessManager(staleness=0, batch_size=1, group_size=2, redundant_batch_size=2)
        a, b = m.try_reserve(0), m.try_reserve(0)
        m.complete(b, "b1", 0)
        assert m.entry_members(b) == ["b1"] and m.entry_buffer(b) is None
        m.complete(a, "a1", 0)
        m.complete(a, "a2", 0)  # a occupies buffer 0 and fills it: b is passively aborted with what it held
        assert m.entry_buffer(a) == 0 and m.entry_buffer(b) is None and m.entry_buffer("nope") is None
        assert m.drain_aborted_groups() == [(b, ["b1"])]
        assert m.drain_aborted_groups() == [] and m.drain_aborted() == []

    def test_passive_abort_of_later_buffer_when_all_earlier_full(self):
        """A reservation at r is ended when every buffer in [T, r] has B occupied groups."""
        m = StalenessManager(staleness=1, batch_size=1, group_size=1, redundant_batch_size=2)
        a = m.try_reserve(0)  # buffer 1
        b = m.try_reserve(0)  # buffer 1
        c = m.try_reserve(0)  # buffer 0 (fallback)
        m.complete(c, "c", 0)  # occupies 0
        m.complete(a, "a", 0)  # occupies 1 -> buffers 0 and 1 full -> b is doomed
        assert m.drain_aborted() == [b]


class TestConsume:
    @pytest.mark.parametrize("extra", [0, 1])
    def test_consume_returns_groups_in_occupy_order(self, extra):
        m = StalenessManager(staleness=1, batch_size=2, group_size=2, redundant_batch_size=2 + extra)
        a, b = m.try_reserve(0), m.try_reserve(0)
        m.complete(b, "b1", 0), m.complete(a, "a1", 0), m.complete(b, "b2", 0), m.complete(a, "a2", 0)
        batch = m.consume()
        assert batch.version == 0 and m.train_version == 1
        assert batch.groups == [["b1", "b2"], ["a1", "a2"]]
        assert batch.entries == [b, a]

    def test_not_ready(self):
        m = StalenessManager(staleness=1, batch_size=2, group_size=1)
        fill_group(m, m.try_reserve(0), 0)
        with pytest.raises(NotReadyError):
            m.consume()

    def test_consumed_buffer_is_gone(self):
        m = StalenessManager(staleness=0, batch_size=1, group_size=1)
        fill_buffer(m, 0)
        m.consume()
        with pytest.raises(ValueError):
            m.state(0)
        assert m.state(1) == BufferState.PENDING


class TestStatesAndSnapshot:
    def test_all_four_states(self):
        m = StalenessManager(staleness=0, batch_size=1, group_size=1, redundant_batch_size=2)
        assert m.state(0) == "PENDING"
        a, _ = m.try_reserve(0), m.try_reserve(0)
        assert m.state(0) == "STUCK"
        m.complete(a, "a", 0)
        assert m.state(0) == "READY_WITH_CAPACITY"  # b was passively aborted, freeing a slot
        m2 = StalenessManager(staleness=0, batch_size=1, group_size=1)
        fill_buffer(m2, 0)
        assert m2.state(0) == "READY"

    def test_snapshot_is_picklable_and_restores_exactly(self):
        m = StalenessManager(staleness=2, batch_size=2, group_size=2, redundant_batch_size=3)
        a, b = m.try_reserve(0), m.try_reserve(0)
        m.complete(a, "a1", 0)
        snap = pickle.loads(pickle.dumps(m.snapshot()))
        r = StalenessManager.restore(snap)
        for mm in (m, r):
            mm.complete(a, "a2", 0)
            mm.complete(b, "b1", 0)
        assert r.snapshot() == m.snapshot()
        assert r.try_reserve(0) == m.try_reserve(0)

    def test_snapshot_entries_are_plain_tuples_that_snapshot_entry_names(self):
        """A snapshot's entries are plain tuples (a checkpoint does not depend on a psrl class) in the field order
        of SnapshotEntry, which reads them by name."""
        m = StalenessManager(staleness=1, batch_size=2, group_size=2)
        a, b = m.try_reserve(0), m.try_reserve(0)
        fill_group(m, a, 0)
        m.complete(b, "b0", 0)
        snap = m.snapshot()
        reserved, occupied = snap["buffers"][0]
        assert reserved == [] and [SnapshotEntry._make(e).id for e in occupied] == [a]
        (row,) = snap["buffers"][1][0]
        held = SnapshotEntry._make(row)
        assert type(row) is tuple and (held.id, held.version, held.buffer, held.members) == (b, 0, 1, ["b0"])
        assert (held.state, held.min_version, held.bound) == (0, 0, 1)

    def test_occupy_is_complete(self):
        """``occupy`` is the same method as ``complete`` (the protocol's word): the same results and state."""
        assert StalenessManager.occupy is StalenessManager.complete
        runs = []
        for hand_in in ("complete", "occupy"):
            m = StalenessManager(staleness=1, batch_size=1, group_size=2)
            eid = m.try_reserve(0)
            runs.append(([getattr(m, hand_in)(eid, f"t{i}", 0) for i in range(3)], m.snapshot()))
        assert runs[0] == runs[1]
        assert [r.status for r in runs[0][0]] == [Status.PENDING, Status.OCCUPIED, Status.SURPLUS]

    def test_counters_and_events(self):
        events = []
        m = StalenessManager(staleness=1, batch_size=1, group_size=1, on_event=events.append)
        eid = m.try_reserve(0)
        m.complete(eid, "x", 0)
        m.consume()
        assert [e.kind for e in events] == [EventKind.RESERVE, EventKind.OCCUPY, EventKind.CONSUME]
        assert [e.kind for e in events] == ["reserve", "occupy", "consume"]  # a str enum: the plain strings
        assert json.dumps([e.kind for e in events]) == '["reserve", "occupy", "consume"]'
        assert events[1].buffer == 0 and events[1].reserved_buffer == 1
        assert m.stats.occupies_by_offset == [1, 0] and m.stats.staleness_hist == [1, 0]

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(staleness=-1),
            dict(batch_size=0),
            dict(redundant_batch_size=1, batch_size=2),
            dict(redundant_group_size=1, group_size=2),
            dict(max_staleness=0),
        ],
    )
    def test_bad_arguments(self, kwargs):
        base = dict(staleness=1, batch_size=2, group_size=2)
        base.update(kwargs)
        with pytest.raises(ValueError):
            StalenessManager(**base)


class TestSetStaleness:
    """The bound of new reservations changes at run time within ``[0, max_staleness]``; entries keep theirs."""

    def test_a_lower_bound_keeps_earlier_reservations_where_they_are_and_places_new_ones_by_it(self):
        m = StalenessManager(staleness=2, batch_size=1, group_size=1, redundant_batch_size=2, max_staleness=3)
        old = m.try_reserve(0)
        assert m.blocking(2) == [old]
        assert m.set_staleness(0) == 2 and m.staleness == 0
        assert m.blocking(2) == [old] and m.drain_aborted() == []  # nothing ends when the bound falls
        new = m.try_reserve(0)
        assert m.blocking(0) == [new]  # worst case under the new bound: buffer 0 + 0
        assert m.buffer_states() == {0: "PENDING", 1: "PENDING", 2: "PENDING"}  # buffer 2 still holds `old`
        fill_group(m, new, 0)
        assert m.consume().groups == [[f"t{new}-0"]]
        with pytest.raises(StaleVersionError):  # 0 + 0 < T = 1: version 0 is too old for the new bound
            m.try_reserve(0)
        assert fill_group(m, old, 0) == (Status.OCCUPIED, 1)  # the old entry lands within its own bound of 2
        batch = m.consume()
        assert batch.version - batch.group_versions[0] == 1 <= 2

    def test_a_higher_bound_admits_what_the_old_one_refused(self):
        m = StalenessManager(staleness=0, batch_size=1, group_size=1, max_staleness=2)
        assert m.try_reserve(0) is not None and m.try_reserve(0) is None  # buffer 0 is full
        m.set_staleness(2)
        eid = m.try_reserve(0)
        assert eid is not None and m.blocking(2) == [eid]
        assert len(m.stats.staleness_hist) == 3  # counters sized to the ceiling

    @pytest.mark.parametrize("bad", [-1, 4, True, 1.0, "2"])
    def test_a_bound_outside_zero_to_the_ceiling_is_an_error_that_changes_nothing(self, bad):
        m = StalenessManager(staleness=1, batch_size=1, group_size=1, max_staleness=3)
        with pytest.raises(ValueError, match=r"\[0, 3\] \(max_staleness\)"):
            m.set_staleness(bad)
        assert m.staleness == 1

    def test_the_snapshot_keeps_each_reservations_bound_and_the_ceiling(self):
        m = StalenessManager(staleness=3, batch_size=1, group_size=1, max_staleness=3)
        a = m.try_reserve(0)
        m.set_staleness(1)
        b = m.try_reserve(0)
        snap = pickle.loads(pickle.dumps(m.snapshot()))
        r = StalenessManager.restore(snap)
        assert (r.staleness, r.max_staleness) == (1, 3)
        bounds = {SnapshotEntry._make(row).id: SnapshotEntry._make(row).bound for row in snap["buffers"][3][0]}
        bounds.update({SnapshotEntry._make(row).id: SnapshotEntry._make(row).bound for row in snap["buffers"][1][0]})
        assert bounds == {a: 3, b: 1}
        assert r.snapshot() == m.snapshot()

    def test_a_snapshot_of_format_1_restores_with_its_staleness_as_every_bound(self):
        """Checkpoints written before the bound could change (format 1: 6 fields per entry, no ceiling)."""
        m = StalenessManager(staleness=2, batch_size=2, group_size=1)
        a = m.try_reserve(0)
        snap = m.snapshot()
        old = dict(
            snap,
            format=1,
            buffers={
                b: ([row[:6] for row in res], [row[:6] for row in occ]) for b, (res, occ) in snap["buffers"].items()
            },
        )
        del old["max_staleness"]
        r = StalenessManager.restore(old)
        assert r.snapshot() == snap and r.blocking(2) == [a]
