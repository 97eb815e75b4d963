"""The discrete-event engine every policy shares: simulated clock, slots, trainer, weight versions.

Model (time in simulated seconds; one heap of wall-time events, one of completions in generation time):

* ``slots`` generation slots; a trajectory occupies one from launch to completion (or cancel).
* Work is made of groups. When a slot is free for each member, the engine asks the policy for a
  new :class:`Group` (``next_group``) and launches all its members at once, each tagged with
  V_traj = the version the generators hold (a retried member: the version at its relaunch).
* The trainer trains one batch at a time; a step takes ``train_time`` (+ per-token part). When
  step ``c`` ends the trainer holds version ``c + 1``; generators hold it ``sync_time`` later. A
  policy may publish only some versions (``publishes``), and says what the sync does to the rest
  of the system, as its system does it: ``sync_blocks_trainer`` (the next step waits for the sync)
  and ``sync_pauses_generation`` (in-flight generations stop for the sync and resume after it, and
  nothing new is launched meanwhile). psrl's default is neither.
* Generation runs on its own clock, which stops while generation is paused: a trajectory's
  completion event is kept in generation time, so a pause delays every in-flight one by its length.
* The simulation stops when the ``steps``-th training step ends.

Per-trajectory state lives in flat lists indexed by launch number (fast at a million
trajectories); a policy subclasses :class:`Engine` and implements the hooks at the bottom.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from psrl.sim.metrics import Recorder, Result
from psrl.sim.workload import Workload

__all__ = ["Engine", "Group", "SimulationStuck"]

_DONE, _TRAINED, _PUBLISH, _CALL = 0, 1, 2, 3


class SimulationStuck(RuntimeError):
    """No event is left but training has not finished: the policy deadlocked."""


class Group:
    """One prompt's group of trajectories, as the engine and a policy see it."""

    __slots__ = ("ordinal", "key", "size", "unlaunched", "members", "completed", "ended", "batch")

    def __init__(self, ordinal: int, size: int, key=None, batch: int = 0):
        self.ordinal = ordinal  # creation order: the i-th group gets the i-th filter draw
        self.key = key  # policy's handle (psrl: the manager's entry id)
        self.size = size  # members to launch
        self.unlaunched = size
        self.members: list[int] = []  # launched trajectory indices
        self.completed: list[int] = []  # of those, the ones that finished generating
        self.ended = False  # no longer wanted (aborted, filtered, consumed)
        self.batch = batch  # batched policies: the batch it belongs to


class Engine:
    """Shared machinery; subclasses are the policies."""

    name = "engine"
    sync_blocks_trainer = False
    """The trainer starts no step while a weight sync runs."""
    sync_pauses_generation = False
    """In-flight generation stops during a weight sync, and no trajectory is launched."""

    def __init__(self, wl: Workload):
        self.wl = wl
        self.group_slots = wl.group_size  # slots a new group needs (psrl: N')
        self.eta = wl.staleness
        self.now = 0.0
        self.free = wl.slots
        self.gen_version = 0
        self.trainer_version = 0
        self.trainer_busy = False
        self.heap: list = []  # trainer, publish and timer events, in wall time
        self.gen_heap: list = []  # completion events, in generation time
        self.gen_paused = False
        self._pause_start = 0.0
        self.paused_total = 0.0  # wall seconds generation has been paused so far
        self.syncing = False
        self._seq = itertools.count()
        self.pending: deque[Group] = deque()
        self.n_groups = 0
        self.stream = wl.gen_stream()
        self.filter_u = wl.filter_stream()
        self.filter_draws: list[float] = []
        self.rec = Recorder(wl.slots, wl.staleness)
        # per-trajectory state, indexed by launch number
        self.t_drawn: list[float] = []
        self.t_start: list[float] = []  # generation-clock time of launch
        self.t_ver: list[int] = []
        self.t_group: list[Group] = []
        self.t_alive = bytearray()
        self.truncated: dict[int, float] = {}
        self._busy_integral = 0.0
        self._last_t = 0.0

    # ------------------------------------------------------------------ main loop

    def run(self) -> Result:
        """Simulate until ``steps`` training steps have ended; return the measurements."""
        steps = self.wl.steps
        heap, gen_heap = self.heap, self.gen_heap
        pop = heapq.heappop
        alive = self.t_alive
        slots = self.wl.slots
        self.fill()
        while self.trainer_version < steps:
            # the next event: the earlier of the wall-time heap and the (running) generation clock
            if gen_heap and not self.gen_paused:
                g0 = gen_heap[0]
                tg = g0[0] + self.paused_total
                if heap and (heap[0][0], heap[0][1]) < (tg, g0[1]):
                    t, _, kind, arg = pop(heap)
                else:
                    pop(gen_heap)
                    t, kind, arg = tg, _DONE, g0[3]
            elif heap:
                t, _, kind, arg = pop(heap)
            else:
                raise SimulationStuck(f"{self.name}: no events left after {self.trainer_version} steps")
            if not self.gen_paused:  # a paused slot is held but generates nothing: idle
                self._busy_integral += (slots - self.free) * (t - self._last_t)
            self._last_t = self.now = t
            if kind == _DONE:
                if not alive[arg]:
                    continue  # cancelled earlier; its slot is already free
                alive[arg] = 0
                self.free += 1
                self.on_member_done(arg, self.t_group[arg])
            elif kind == _TRAINED:
                self._train_done(arg)
            elif kind == _PUBLISH:
                self._publish(arg)
            else:
                arg()
            self.fill()
        return self.rec.result(self.name, self.wl.ideal_steps_per_hour(), len(self.t_drawn))

    def fill(self) -> None:
        """Give free slots work: a member waiting for relaunch (a retry), else a new group once it
        has a slot for every member (``psrl train``'s dispatcher takes N' slots, then reserves)."""
        if self.gen_paused:
            return
        pending = self.pending
        while self.free > 0:
            if pending:
                g = pending[0]
                if g.ended or g.unlaunched == 0:
                    pending.popleft()
                    continue
                self.launch(g)
            else:
                if self.free < self.group_slots:
                    return
                fresh = self.next_group()
                if fresh is None:
                    return
                pending.append(fresh)

    def new_group(self, size: int, key=None, batch: int = 0) -> Group:
        """A group numbered in creation order (so the i-th group gets the same filter draw everywhere)."""
        g = Group(self.n_groups, size, key, batch)
        self.n_groups += 1
        return g

    def launch(self, g: Group) -> int:
        """Start one member of ``g`` in a free slot; its time is the stream's next value."""
        idx = len(self.t_drawn)
        d = self.stream.next()
        self.t_drawn.append(d)
        gnow = self.now - self.paused_total
        self.t_start.append(gnow)
        self.t_ver.append(self.gen_version)
        self.t_group.append(g)
        self.t_alive.append(1)
        g.members.append(idx)
        g.unlaunched -= 1
        self.free -= 1
        heapq.heappush(self.gen_heap, (gnow + d, next(self._seq), _DONE, idx))
        return idx

    def gen_clock(self) -> float:
        """Generation time now: wall time minus every pause so far (and the current one)."""
        paused = self.paused_total + (self.now - self._pause_start if self.gen_paused else 0.0)
        return self.now - paused

    def at(self, t: float, fn) -> None:
        """Call ``fn()`` at wall time ``t`` (a policy's own timer)."""
        heapq.heappush(self.heap, (t, next(self._seq), _CALL, fn))

    def pause_generation(self) -> None:
        """Stop every in-flight generation (and launches) until :meth:`resume_generation`."""
        if not self.gen_paused:
            self.gen_paused = True
            self._pause_start = self.now

    def resume_generation(self) -> None:
        """In-flight generations continue where they stopped."""
        if self.gen_paused:
            self.gen_paused = False
            self.paused_total += self.now - self._pause_start

    def cancel(self, idx: int) -> None:
        """Stop an in-flight generation now; its slot frees at once."""
        if self.t_alive[idx]:
            self.t_alive[idx] = 0
            self.free += 1
            self.rec.cancelled(self.t_drawn[idx], self.gen_clock() - self.t_start[idx])

    def end_group(self, g: Group) -> None:
        """Give up a group: cancel members in flight, discard completed ones, launch no more."""
        g.ended = True
        g.unlaunched = 0
        for idx in g.members:
            self.cancel(idx)
        for idx in g.completed:
            self.discard(idx)
        g.completed = []

    def discard(self, idx: int) -> None:
        """A completed trajectory is thrown away."""
        self.rec.discarded(self.t_drawn[idx], self.slot_seconds(idx))

    def slot_seconds(self, idx: int) -> float:
        """Generation seconds actually spent (the drawn time, or less if truncated)."""
        t = self.truncated.get(idx) if self.truncated else None
        return self.t_drawn[idx] if t is None else t

    def truncate(self, idx: int) -> None:
        """Force-complete an in-flight generation with its partial output (it still counts as done)."""
        self.t_alive[idx] = 0
        self.free += 1
        self.truncated[idx] = self.gen_clock() - self.t_start[idx]

    def keep_group(self, g: Group) -> bool:
        """The group filter: drops the i-th group with probability filter_drop_rate (same draw per policy)."""
        rate = self.wl.filter_drop_rate
        if rate <= 0.0:
            return True
        draws = self.filter_draws
        while len(draws) <= g.ordinal:
            draws.append(self.filter_u.next())
        return draws[g.ordinal] >= rate

    # ------------------------------------------------------------------ trainer

    def start_training(self, batch: list[int], version: int) -> None:
        """Train on trajectories ``batch`` consumed at ``version``; record their staleness."""
        rec, ver, drawn = self.rec, self.t_ver, self.t_drawn
        tokens = 0.0
        for idx in batch:
            slot = self.slot_seconds(idx)
            rec.trained(version - ver[idx], drawn[idx], slot)
            tokens += slot
        wl = self.wl
        dur = wl.train_time + wl.train_time_per_token * tokens * wl.tokens_per_second
        self.trainer_busy = True
        heapq.heappush(self.heap, (self.now + dur, next(self._seq), _TRAINED, dur))

    def _train_done(self, duration: float) -> None:
        self.trainer_busy = False
        self.trainer_version += 1
        self.rec.step_done(self.now, duration, self._busy_integral)
        self.on_step_done(duration)
        v = self.trainer_version
        if v >= self.wl.steps:
            return  # the run ends here: start nothing more
        if self.publishes(v):
            if self.wl.sync_time > 0:
                if self.sync_blocks_trainer:
                    self.syncing = self.trainer_busy = True
                if self.sync_pauses_generation:
                    self.pause_generation()
                heapq.heappush(self.heap, (self.now + self.wl.sync_time, next(self._seq), _PUBLISH, v))
            else:
                self.gen_version = v
                self.on_publish()
        self.on_trainer_free()

    def _publish(self, v: int) -> None:
        """The sync of weights ``v`` ends: generators hold them; a paused generation and a blocked trainer go on."""
        self.gen_version = v
        self.resume_generation()
        self.on_publish()
        if self.syncing:
            self.syncing = self.trainer_busy = False
            self.on_trainer_free()

    # ------------------------------------------------------------------ policy hooks

    def next_group(self) -> Group | None:
        """A new group to generate now (a slot is free and no started group waits), or None."""
        raise NotImplementedError

    def on_member_done(self, idx: int, g: Group) -> None:
        """Trajectory ``idx`` of ``g`` finished generating (its slot is already free)."""
        raise NotImplementedError

    def on_trainer_free(self) -> None:
        """The trainer finished a step; start the next one if data is ready."""
        raise NotImplementedError

    def on_step_done(self, duration: float) -> None:
        """Training step ``trainer_version`` ended after ``duration`` seconds of training (before its publish)."""

    def publishes(self, version: int) -> bool:
        """Whether generators receive weights ``version`` (every version by default)."""
        return True

    def on_publish(self) -> None:
        """Generators now hold ``gen_version``."""
