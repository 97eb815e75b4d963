"""The staleness policies of the systems users would otherwise pick, on the shared engine.

Each is written as the issue defines it; ``eta`` is ``psrl.staleness`` and groups have N members
(the redundancy keys B', N' belong to psrl). Every policy trains B groups per step, and a group the
filter drops is discarded and its place taken by a new one.

* ``sync`` -- batch k is generated with weights k, then trained (staleness 0).
* ``one_step_off`` -- batch k+1 is generated (with the weights the generators hold) while batch k
  trains; one batch generates at a time (verl / slime one-step-off).
* ``areal`` -- count admission: a group is submitted while accepted + running < (eta + v + 1) * B
  (v: generator version, accepted: cumulative completed groups); the trainer takes completed
  groups oldest first. Stragglers are trained whatever their staleness.
* ``discard_requeue`` -- groups are admitted while running + waiting < (eta + 1) * B; when the
  trainer builds a batch it drops (and so regenerates) every waiting group whose staleness would
  exceed eta (Tinker cookbook / NeMo RL / prime-rl).
* ``sample_budget`` -- verl fully-async: at most B * (1 + eta) * k groups are submitted per
  parameter-sync period (k = ``trigger_parameter_sync_step``; the count restarts at the groups still
  running or waiting when weights are synced), weights are synced every k steps, and in-flight
  generations continue across a sync (partial rollout) keeping their V_traj.
"""

from __future__ import annotations

from collections import deque

from psrl.sim.engine import Engine, Group
from psrl.sim.workload import Workload

__all__ = ["BatchedPolicy", "Sync", "OneStepOff", "Areal", "DiscardRequeue", "SampleBudget"]


class _QueuePolicy(Engine):
    """Shared part of the continuous policies: a FIFO of completed groups the trainer takes B at a time."""

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.running = 0
        self.ready: deque[Group] = deque()

    def next_group(self) -> Group | None:
        if not self.admit():
            return None
        self.running += 1
        return self.new_group(self.wl.group_size)

    def admit(self) -> bool:
        """Whether one more group may be submitted now."""
        raise NotImplementedError

    def on_member_done(self, idx: int, g: Group) -> None:
        g.completed.append(idx)
        if len(g.completed) < g.size:
            return
        self.running -= 1
        if self.keep_group(g):
            self.accept(g)
            self.ready.append(g)
            self.on_trainer_free()
        else:
            self.end_group(g)

    def accept(self, g: Group) -> None:
        """A completed group passed the filter (AReaL counts it)."""

    def on_trainer_free(self) -> None:
        if self.trainer_busy or len(self.ready) < self.wl.batch_size:
            return
        batch = []
        for _ in range(self.wl.batch_size):
            batch.extend(self.ready.popleft().completed)
        self.start_training(batch, self.trainer_version)


class Areal(_QueuePolicy):
    """AReaL's capacity formula: (eta + v + 1) * B - (accepted + running)."""

    name = "areal"

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.accepted = 0

    def admit(self) -> bool:
        return self.accepted + self.running < (self.eta + self.gen_version + 1) * self.wl.batch_size

    def accept(self, g: Group) -> None:
        self.accepted += 1


class SampleBudget(_QueuePolicy):
    """verl fully-async: a sample budget per parameter-sync period, partial rollout across syncs."""

    name = "sample_budget"

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.k = wl.trigger_parameter_sync_step
        self.budget = wl.batch_size * (1 + self.eta) * self.k
        self.submitted = 0

    def admit(self) -> bool:
        if self.submitted >= self.budget:
            return False
        self.submitted += 1
        return True

    def publishes(self, version: int) -> bool:
        return version % self.k == 0

    def on_publish(self) -> None:
        # verl resets its count to the samples still in flight or queued: they are the stale ones.
        self.submitted = self.running + len(self.ready)


class DiscardRequeue(_QueuePolicy):
    """Admit up to (eta + 1) * B groups ahead; drop groups that would be too stale when trained."""

    name = "discard_requeue"

    def admit(self) -> bool:
        return self.running + len(self.ready) < (self.eta + 1) * self.wl.batch_size

    def on_trainer_free(self) -> None:
        if self.trainer_busy:
            return
        c = self.trainer_version
        ver = self.t_ver
        fresh: deque[Group] = deque()
        for g in self.ready:
            if c - min(ver[i] for i in g.completed) > self.eta:
                self.end_group(g)  # discarded; admission regenerates it
            else:
                fresh.append(g)
        self.ready = fresh
        super().on_trainer_free()


class BatchedPolicy(Engine):
    """Generate one batch at a time; batch j may start once batch j-1 is generated and the
    generators hold version >= j - lag. lag 0 is synchronous RL, lag 1 one-step-off."""

    lag = 0

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.batch = 0          # batch being generated
        self.kept: list[Group] = []
        self.in_progress = 0    # groups of this batch launched and not finished
        self.started = False
        self.done: deque[list[int]] = deque()

    def next_group(self) -> Group | None:
        B = self.wl.batch_size
        if not self.started:
            if self.gen_version < self.batch - self.lag:
                return None
            self.started = True
        if len(self.kept) + self.in_progress >= B:
            return None
        self.in_progress += 1
        return self.new_group(self.wl.group_size, batch=self.batch)

    def on_member_done(self, idx: int, g: Group) -> None:
        g.completed.append(idx)
        if len(g.completed) < g.size:
            return
        self.in_progress -= 1
        if not self.keep_group(g):
            self.end_group(g)
            return
        self.kept.append(g)
        if len(self.kept) == self.wl.batch_size:
            self.done.append([i for k in self.kept for i in k.completed])
            self.kept, self.started = [], False
            self.batch += 1
            self.on_trainer_free()

    def on_trainer_free(self) -> None:
        if not self.trainer_busy and self.done:
            self.start_training(self.done.popleft(), self.trainer_version)


class Sync(BatchedPolicy):
    name = "sync"
    lag = 0


class OneStepOff(BatchedPolicy):
    name = "one_step_off"
    lag = 1
