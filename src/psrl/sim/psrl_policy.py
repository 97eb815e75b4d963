"""The ``psrl`` policy: the engine drives the real :class:`psrl.staleness.StalenessManager`.

Nothing of the protocol is re-implemented here. The engine only decides *when* to call it:

* Reserve only when a slot is free for each of the N' members, as ``psrl train``'s dispatcher does
  (a reservation that waits for slots spends its staleness window); all members start at once
  with V_traj = the version the generators hold.
  A refusal (back-pressure or ``StaleVersionError``) parks admission until something that can change
  the answer happens: an occupy, a consume, a filtered/surplus group, a passive abort, or new weights.
* Each finished member is handed to ``complete``; an ``occupied`` group cancels its members still
  running (the N' - N slowest), ``filtered`` / ``surplus`` groups are discarded.
* Entries the manager ends itself (``drain_aborted``, e.g. the B' - B surplus reservations) have
  their in-flight members cancelled at once.
* The trainer consumes buffer T as soon as it is READY (or READY_WITH_CAPACITY).
* Proactive filter (``psrl.proactive_filter_strategy``): when a buffer is STUCK with at most
  ``threshold`` RESERVED entries, the running members of each such group (once per group) are retried
  (cancelled and relaunched with the next generation time of the stream) or truncated (completed now
  with their partial output). ``psrl.proactive_filter_strategy.scope = head`` acts only on buffer T and
  only while the trainer waits for it, after ``psrl.proactive_filter_strategy.grace`` seconds of waiting
  (counted from when the trainer began waiting: the end of its last step, or the start): it cuts only what
  actually holds the trainer up, and later, so less is cut. ``psrl train``'s filter
  (:mod:`psrl.rollout.client.proactive`) runs the same rule.
"""

from __future__ import annotations

from psrl.sim.divergence import StepLog
from psrl.sim.engine import Engine, Group
from psrl.sim.metrics import Result, warmup_steps
from psrl.sim.workload import Workload
from psrl.staleness import BufferState, StalenessManager, StaleVersionError

_READY = (BufferState.READY, BufferState.READY_WITH_CAPACITY)

__all__ = ["PsrlPolicy"]


class PsrlPolicy(Engine):
    """Reserve / Occupy / Consume through the real manager."""

    name = "psrl"

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.group_slots = wl.redundant_group_size
        self.m = StalenessManager(
            staleness=wl.staleness,
            batch_size=wl.batch_size,
            group_size=wl.group_size,
            redundant_batch_size=wl.redundant_batch_size,
            redundant_group_size=wl.redundant_group_size,
            group_filter=self.group_filter if wl.filter_drop_rate > 0 else None,
        )
        self.blocked = False
        self.by_entry: dict = {}
        self.retried: set[int] = set()
        self._in_proactive = False
        # head scope: when the trainer began waiting for buffer T (T = 0: from the start, as psrl train's trainer)
        self._waiting_since: dict[int, float] = {0: 0.0}
        self._grace_armed: set[int] = set()
        # psrl.adaptive_staleness: psrl train's controller, fed the simulated step rows (sim.divergence)
        self.log = StepLog()
        self._div: dict[str, float] = {}
        self._last_end = 0.0
        self.controller = None
        if wl.adaptive.enable:
            from psrl.runtime.adaptive import StalenessController

            self.controller = StalenessController(wl.adaptive, wl.staleness, self.m.set_staleness)
            self.name = "psrl+adaptive"

    def run(self) -> Result:
        res = super().run()
        res.extra.update(self.log.extra(warmup_steps(self.trainer_version)))
        return res

    def on_step_done(self, duration: float) -> None:
        """The step row psrl train would write (the figures the controller reads); a move applies to the next
        reservation."""
        row = {
            "step": self.trainer_version,
            "time/step_s": self.now - self._last_end,
            "time/train_s": duration,
            **self._div,
            "staleness/bound": self.m.staleness,
        }
        self._last_end = self.now
        self.log.add(row)
        if self.controller is not None and self.controller.observe(row) is not None:
            self.log.moves += 1
            self.blocked = False

    # ------------------------------------------------------------------ reserve

    def next_group(self) -> Group | None:
        if self.blocked:
            return None
        try:
            eid = self.m.try_reserve(self.gen_version)
        except StaleVersionError:
            eid = None
        if eid is None:
            self.blocked = True
            return None
        g = self.new_group(self.wl.redundant_group_size, key=eid)
        self.by_entry[eid] = g
        return g

    def on_publish(self) -> None:
        self.blocked = False

    def group_filter(self, trajs: list) -> bool:
        """The manager's group filter: the engine's seeded per-group draw."""
        return self.keep_group(self.t_group[trajs[0]])

    # ------------------------------------------------------------------ complete

    def on_member_done(self, idx: int, g: Group) -> None:
        res = self.m.complete(g.key, idx, self.t_ver[idx])
        status = res.status
        if status == "pending":
            g.completed.append(idx)
            return
        self.blocked = False
        if status == "occupied":
            g.completed = []  # the manager holds them now
            g.unlaunched = 0
            for other in g.members:
                self.cancel(other)  # N' > N: the slowest members are not needed
            self._drain()
            if res.buffer == self.m.train_version:
                self.on_trainer_free()
        elif status in ("filtered", "surplus") and not g.ended:
            g.completed.append(idx)
            self.by_entry.pop(g.key, None)
            self.end_group(g)
            self._drain()
        else:  # rejected, or a late member of an ended group
            self.discard(idx)
        self._proactive()

    def _drain(self) -> None:
        """Cancel the generations of every entry the manager passively aborted."""
        for eid in self.m.drain_aborted():
            g = self.by_entry.pop(eid, None)
            if g is not None:
                self.end_group(g)

    # ------------------------------------------------------------------ consume

    def on_trainer_free(self) -> None:
        if self.trainer_busy:
            return
        m = self.m
        if m.state(m.train_version) not in _READY:
            self._proactive()
            return
        batch = m.consume()
        trajs = []
        by_entry, t_group = self.by_entry, self.t_group
        for members in batch.groups:
            trajs.extend(members)
            g = t_group[members[0]]
            g.ended = True
            by_entry.pop(g.key, None)
        self.blocked = False
        self._drain()
        self._div = self.wl.divergence.batch(batch.version - self.t_ver[i] for i in trajs)
        self.start_training(trajs, batch.version)
        self._proactive()

    # ------------------------------------------------------------------ proactive filter

    def _proactive(self) -> None:
        """Retry or truncate the running members of STUCK buffers in ``[T, T + eta]`` that are down to
        ``threshold`` RESERVED entries, each group at most once (as ``psrl.rollout.client.proactive`` does)."""
        method = self.wl.proactive_method
        if method is None or self._in_proactive:
            return
        self._in_proactive = True
        try:
            while self._sweep(method):
                pass
        finally:
            self._in_proactive = False

    def _sweep(self, method: str) -> bool:
        """One pass over the live buffers; True when a truncation changed the state (pass again)."""
        m = self.m
        T = m.train_version
        changed = False
        last = T + self.m.staleness  # the bound in force (psrl.adaptive_staleness may hold it under the ceiling)
        if self.wl.proactive_scope == "head":
            if self.trainer_busy:
                return False
            grace = self.wl.proactive_grace
            if grace > 0:
                since = self._waiting_since.setdefault(T, self.now)
                if self.now < since + grace:
                    if T not in self._grace_armed:
                        self._grace_armed.add(T)
                        self.at(since + grace, self._proactive)
                    return False
            last = T
        for b in range(T, last + 1):
            if m.train_version != T or m.state(b) is not BufferState.STUCK:
                continue
            eids = m.blocking(b)
            if len(eids) > self.wl.proactive_threshold:
                continue
            for eid in eids:
                g = self.by_entry.get(eid)
                if g is not None and not g.ended and g.ordinal not in self.retried:
                    self._act(g, method)
                    changed = changed or method == "truncate"
        return changed

    def _act(self, g: Group, method: str) -> None:
        self.retried.add(g.ordinal)
        for idx in [i for i in g.members if self.t_alive[i]]:
            if not self.t_alive[idx] or g.ended:
                continue  # an earlier truncation completed the group
            if method == "retry":
                self.cancel(idx)
                g.unlaunched += 1
                self.pending.appendleft(g)  # relaunched first, with a newer V_traj and a fresh draw
            else:
                self.truncate(idx)
                self.on_member_done(idx, g)
