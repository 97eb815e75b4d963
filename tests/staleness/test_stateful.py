"""Random interleavings of every operation against the slow reference model (hypothesis stateful).

Each step runs the same operation on the fast manager and on ``RefManager``, compares the
outcome, then checks every guarantee of the spec: staleness bound, exact admission (same
answers as the reference), nothing lost silently (conservation of trajectories), counts never
negative, buffer states equal, and snapshot/restore continuing exactly. The bound itself changes at
random points (``set_staleness`` within ``[0, max_staleness]``): every trained trajectory must satisfy the
bound in force when its entry was reserved.
"""

from __future__ import annotations

import pickle

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from psrl.staleness import NotReadyError, StalenessManager, StaleVersionError

from .reference import RefManager


class KeepEven:
    """A picklable group filter: keep a group whose member ids sum to an even number."""

    def __call__(self, group):
        return sum(t[1] for t in group) % 2 == 0


class Protocol(RuleBasedStateMachine):
    @initialize(
        eta=st.integers(0, 3),
        headroom=st.integers(0, 2),
        B=st.integers(1, 3),
        extra_B=st.integers(0, 2),
        N=st.integers(1, 3),
        extra_N=st.integers(0, 2),
        use_filter=st.booleans(),
        T0=st.integers(0, 2),
    )
    def setup(self, eta, headroom, B, extra_B, N, extra_N, use_filter, T0):
        self.eta, self.B, self.N, self.Np = eta, B, N, N + extra_N
        self.ceiling = eta + headroom
        f = KeepEven() if use_filter else None
        self.filter = f
        self.m = StalenessManager(
            eta, B, N, B + extra_B, N + extra_N, group_filter=f, train_version=T0, max_staleness=self.ceiling
        )
        self.ref = RefManager(eta, B, N, B + extra_B, group_filter=f, T=T0)
        self.live = []  # entry ids we may complete (including ended ones: must be rejected)
        self.launched = {}  # eid -> members launched so far
        self.next_traj = 0
        self.handed = {}  # traj -> fate: "held" | "reported" | "consumed" | "dropped"
        self.entry_of = {}
        self.bound_of = {}  # eid -> the bound in force when it was reserved

    # ------------------------------------------------------------- operations

    @rule(lag=st.integers(-1, 5))
    def reserve(self, lag):
        v = self.m.train_version - lag
        try:
            eid = self.m.try_reserve(v)
            outcome = "ok" if eid is not None else "refused"
        except StaleVersionError:
            eid, outcome = None, "stale"
        except ValueError:
            eid, outcome = None, "value"
        expected, r = self.ref.reserve(v, eid if eid is not None else ("bogus", v))
        assert outcome == expected, f"fast said {outcome} at v={v}, reference said {expected}"
        if eid is None:
            return
        assert self.m.blocking(r).count(eid) == 1
        assert r <= v + self.eta  # worst-case placement within the bound in force
        self.bound_of[eid] = self.eta
        self.live.append(eid)
        self.launched[eid] = 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), bump=st.integers(0, 1))
    def complete(self, data, bump):
        eid = data.draw(st.sampled_from(self.live))
        version = self._version_of(eid) + bump
        if version > self.m.train_version:
            version = self._version_of(eid)
        traj = (eid, self.next_traj, version)
        self.next_traj += 1
        self.launched[eid] += 1
        expected, buf = self.ref.complete(eid, traj, version)
        res = self.m.complete(eid, traj, version)
        assert res.status == expected, (res, expected)
        assert res.buffer == buf
        if res.status in ("pending", "occupied"):
            self.handed[traj] = "held"
        else:
            self.handed[traj] = "reported"
            if eid not in self.ref.entries:  # filtered or dropped: the whole group is reported
                for t, fate in self.handed.items():
                    if t[0] == eid and fate == "held":
                        self.handed[t] = "reported"
        if res.status == "occupied":
            assert res.buffer <= self._version_of(eid) + self.bound_of[eid] <= self.m.train_version + self.ceiling
        self.entry_of[traj] = eid

    def _version_of(self, eid):
        e = self.ref.entries.get(eid)
        return e["version"] if e else self.m.train_version

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        eid = data.draw(st.sampled_from(self.live))
        expected = self.ref.abort(eid)
        try:
            got = self.m.abort(eid)
        except ValueError:
            assert expected == "value"
            return
        assert got == expected
        if got:
            self._drop_members(eid)

    def _drop_members(self, eid):
        for t, fate in self.handed.items():
            if t[0] == eid and fate == "held":
                self.handed[t] = "dropped"

    @rule(new=st.integers(0, 5))
    def set_staleness(self, new):
        if new > self.ceiling:
            with pytest.raises(ValueError, match="max_staleness"):
                self.m.set_staleness(new)
            return
        assert self.m.set_staleness(new) == self.eta
        self.ref.set_eta(new)
        self.eta = new

    @rule()
    def drain(self):
        got = self.m.drain_aborted()
        assert sorted(got) == sorted(self.ref.drain())
        for eid in got:
            self._drop_members(eid)

    @rule()
    def consume(self):
        expected = self.ref.consume()
        try:
            batch = self.m.consume()
        except NotReadyError:
            assert expected is None
            return
        assert expected is not None
        assert batch.groups == expected
        assert batch.version == self.m.train_version - 1
        for group in batch.groups:
            assert len(group) == self.N
            for traj in group:
                # The staleness bound, checked on every trained trajectory: the bound of its reservation.
                assert batch.version - traj[2] <= self.bound_of[traj[0]] <= self.ceiling
                assert self.handed[traj] == "held"
                self.handed[traj] = "consumed"

    @rule()
    def snapshot_restore(self):
        snap = pickle.loads(pickle.dumps(self.m.snapshot()))
        self.m = StalenessManager.restore(snap, group_filter=self.filter)

    # ------------------------------------------------------------- guarantees

    @invariant()
    def same_buffers(self):
        if not hasattr(self, "m"):
            return
        T = self.m.train_version
        assert T == self.ref.T
        assert self.m.staleness == self.eta and self.m.max_staleness == self.ceiling
        for b in range(T, T + self.ceiling + 2):
            assert self.m.state(b) == self.ref.state(b)
            R, O, E = self.m.counts(b)
            assert (R, O, E) == (self.ref.R(b), self.ref.O(b), self.ref.E(b))
            assert R >= 0 and O >= 0 and E >= 0
            assert sorted(self.m.blocking(b)) == sorted(self.ref.blocking(b))

    @invariant()
    def nothing_lost_silently(self):
        """Every trajectory handed in is consumed, held by a live entry, reported, or its entry was aborted."""
        if not hasattr(self, "m"):
            return
        held = {t for t, fate in self.handed.items() if fate == "held"}
        in_entries = set()
        for e in self.ref.entries.values():
            in_entries.update(e["members"])
        pending_abort = set(self.ref.aborted)
        held_not_aborted = {t for t in held if t[0] not in pending_abort}
        assert held_not_aborted == in_entries
        for t in in_entries:
            assert t in self.m.entry_members(t[0])

    @invariant()
    def no_deadlock(self):
        """If every reserved group completed now, buffer T would be ready or could admit new work."""
        if not hasattr(self, "m"):
            return
        copy = StalenessManager.restore(self.m.snapshot(), group_filter=self.filter)
        T = copy.train_version
        for b in range(T, T + self.ceiling + 1):
            for eid in copy.blocking(b):
                for i in range(self.N - len(copy.entry_members(eid))):
                    copy.complete(eid, (eid, -1 - i, T), T)
        state = copy.state(T)
        assert state in ("READY", "READY_WITH_CAPACITY", "PENDING"), state
        if state == "PENDING":
            assert copy.try_reserve(T) is not None


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@pytest.mark.slow
class TestProtocolLong(Protocol.TestCase):
    """The same machine, 2,000 examples (``-m slow``)."""

    settings = settings(max_examples=2000, stateful_step_count=60, deadline=None)
