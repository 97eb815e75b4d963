"""A slow, obvious model of the protocol, written straight from the spec's rules.

Counts are recomputed from the list of entries every time; nothing is cached. The fast
``StalenessManager`` must agree with it on every operation.
"""

from __future__ import annotations


class RefManager:
    def __init__(self, eta, B, N, Bp=None, group_filter=None, T=0):
        self.eta, self.B, self.N = eta, B, N
        self.Bp = B if Bp is None else Bp
        self.filter = group_filter
        self.T = T
        self.entries = {}  # id -> dict(version, slot, state in {"R","O"}, members)
        self.aborted = []
        self.occupy_clock = 0

    # counts, derived every time
    def R(self, b):
        return sum(1 for e in self.entries.values() if e["state"] == "R" and e["slot"] == b)

    def O(self, b):
        return sum(1 for e in self.entries.values() if e["state"] == "O" and e["slot"] == b)

    def E(self, b):
        return self.Bp - self.R(b) - self.O(b)

    def has_room(self, b):
        return self.O(b) < self.B and self.E(b) > 0

    def state(self, b):
        assert b >= self.T
        if self.O(b) < self.B:
            return "PENDING" if self.E(b) > 0 else "STUCK"
        return "READY_WITH_CAPACITY" if self.E(b) > 0 else "READY"

    def reserve(self, v, eid):
        """Returns ('ok', r) / ('refused', None) / ('value', None) / ('stale', None)."""
        if v > self.T:
            return ("value", None)
        if v + self.eta < self.T:
            return ("stale", None)
        candidates = [b for b in range(self.T, v + self.eta + 1) if self.E(b) > 0]
        if not candidates:
            return ("refused", None)
        r = max(candidates)
        if not any(self.O(b) < self.B for b in range(self.T, r + 1)):
            return ("refused", None)
        self.entries[eid] = dict(version=v, slot=r, state="R", members=[], bound=self.eta)
        return ("ok", r)

    def set_eta(self, eta):
        """The bound of later reservations; entries keep their buffer (and their own bound)."""
        self.eta = eta

    def complete(self, eid, traj, version):
        e = self.entries.get(eid)
        if e is None:
            return ("rejected", None)
        if version < e["version"]:
            return ("value", None)
        if e["state"] == "O":
            return ("surplus", None)
        e["members"].append(traj)
        if len(e["members"]) < self.N:
            return ("pending", None)
        if self.filter is not None and not self.filter(list(e["members"])):
            del self.entries[eid]
            self._passive()
            return ("filtered", None)
        r = e["slot"]
        e["state"] = "released"  # released: counted nowhere while we look for room
        rooms = [b for b in range(self.T, r + 1) if self.has_room(b)]
        if not rooms:
            del self.entries[eid]
            self._passive()
            return ("surplus", None)
        e["state"], e["slot"], e["occ"] = "O", rooms[0], self.occupy_clock
        self.occupy_clock += 1
        self._passive()
        return ("occupied", rooms[0])

    def abort(self, eid):
        e = self.entries.get(eid)
        if e is None:
            return False
        if e["state"] == "O":
            return "value"
        del self.entries[eid]
        self._passive()
        return True

    def _passive(self):
        for eid, e in list(self.entries.items()):
            if e["state"] == "R" and all(self.O(b) == self.B for b in range(self.T, e["slot"] + 1)):
                del self.entries[eid]
                self.aborted.append(eid)

    def drain(self):
        out, self.aborted = self.aborted, []
        return out

    def blocking(self, b):
        return [eid for eid, e in self.entries.items() if e["state"] == "R" and e["slot"] == b]

    def consume(self):
        if self.O(self.T) != self.B:
            return None
        ids = sorted(
            (eid for eid, e in self.entries.items() if e["state"] == "O" and e["slot"] == self.T),
            key=lambda eid: self.entries[eid]["occ"],
        )
        groups = [self.entries.pop(eid)["members"] for eid in ids]
        self.T += 1
        self._passive()
        return groups
