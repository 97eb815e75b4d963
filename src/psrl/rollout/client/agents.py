"""The agent manager: prompts in, groups of trajectories out, through the staleness protocol.

One dispatcher loop, written so the staleness window is spent on generation only::

    take N' worker slots  ->  await reserve(v)  ->  sample a prompt  ->  launch N' members

``v`` is the oldest rollout instance version, so every member may run on any instance and its
own ``V_traj`` (its instance's version when it starts) is ``>= v`` as ``complete`` requires.
Back-pressure comes from the protocol alone (``reserve`` waits), never from a queue limit.

Each member plays one episode of the task through a :class:`~psrl.rollout.serving.session.Session`,
computes its reward and calls ``complete``. Every status is acted on at once:

* ``occupied`` -- the group has its N members: the remaining ``N' - N`` are cancelled;
* ``surplus`` / ``filtered`` / ``rejected``, an entry in ``drain_aborted()`` -- the group's
  in-flight members are cancelled (real asyncio cancellation: the engine drops their requests
  at the next token boundary) and every trajectory it held is recorded with that status.

A raising episode or reward function is retried ``task.reward_retries`` times, then reported
(record ``status: error`` with the reason in ``error``, ``counts/failed``); if the group can no
longer reach N members its entry is aborted, so the slot refills instead of blocking a buffer.
A reward that hangs (an awaitable reward still running after ``task.reward_timeout`` seconds) or
returns a NaN / infinite score takes the same path (:mod:`psrl.rollout.client.rewards`): it is one more way for a
reward to fail. The proactive filter
(:mod:`psrl.rollout.client.proactive`) runs after every change of the protocol state and has the manager
:meth:`~AgentManager.retry` or :meth:`~AgentManager.truncate` a group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar

from psrl.errors import PsrlError, RunError, describe
from psrl.rollout.client.proactive import ProactiveFilter
from psrl.rollout.client.records import Counts, Group, Member, WorkerSlots, trajectory_record
from psrl.rollout.client.remedies import ProactiveRemedies
from psrl.rollout.client.rewards import TaskReward
from psrl.rollout.serving.session import Session
from psrl.rollout.types import InFlight
from psrl.staleness import Batch, SnapshotEntry, StalenessManager, StaleVersionError, Status
from psrl.tasks.base import Episode, Task, episode_to_trajectory
from psrl.types import Sink, Trajectory, segment_versions, stream_seed

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.rollout.types import Pool, TrainerIdle

__all__ = ["AgentManager"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class AgentManager(ProactiveRemedies):
    """Dispatches groups to the rollout pool and feeds the staleness manager.

    Args:
        task: a :class:`psrl.tasks.Task` (``sample_prompt``, ``run_episode``, ``reward``).
        manager: the :class:`psrl.staleness.StalenessManager`.
        pool: the :class:`psrl.rollout.serving.pool.InstancePool`.
        cfg: the run's config: ``psrl.*`` (group sizes, proactive filter), ``trainer.seed`` (the prompt stream, the
            per-episode rngs, and each trajectory's sampling stream with its group number and member index),
            ``task.reward_retries`` and ``task.reward_timeout``.
        workers: agent workers (trajectories generated at once).
        sink: gets one ``trajectory(record)`` call per trajectory that reached the manager.
        trainer: the trainer loop's idle state (the coordinator's), read by the proactive filter's head scope.
    """

    def __init__(
        self,
        task: Task,
        manager: StalenessManager,
        pool: Pool,
        cfg: Config,
        *,
        workers: int,
        sink: Sink | None = None,
        trainer: TrainerIdle | None = None,
    ):
        p = cfg.psrl
        self.task = task
        self.manager = manager
        self.pool = pool
        self.redundant_group_size = p.redundant_group_size
        """N': members launched per group (psrl.redundant_rollout.redundant_rollout_n; N when unset)."""
        self.group_size = p.group_size
        self.retries = int(cfg.task.reward_retries)
        self.reward = TaskReward(task, cfg.task.reward_timeout)
        self.slots = WorkerSlots(workers)
        if self.redundant_group_size > workers:
            raise ValueError(
                f"a group launches {self.redundant_group_size} trajectories but only {workers} agent workers exist "
                "(raise psrl.routing_strategy.max_concurrent_seqs_per_instance or lower "
                "psrl.redundant_rollout.redundant_rollout_n)"
            )
        pf = p.proactive_filter_strategy
        self.proactive = ProactiveFilter(self, pf.method, pf.threshold, scope=pf.scope, grace=pf.grace, trainer=trainer)
        self.sink = sink
        self.seed = int(cfg.trainer.seed)
        self.rng = random.Random(self.seed)
        self.counts = Counts()
        self.failed_in_a_row = 0
        self.max_failed_in_a_row = max(32, 4 * self.redundant_group_size)
        """After this many failed trajectories with no success between them the run stops with the last
        error: a reward function or agent loop that always raises would otherwise retry groups forever."""
        self.groups: dict[Hashable, Group] = {}
        self.next_group = 0
        self.failure: asyncio.Future | None = None
        self._deferred: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ dispatch

    def start(self) -> asyncio.Task:
        """Start the dispatcher; ``failure`` gets the exception of any agent worker that crashes."""
        loop = asyncio.get_running_loop()
        self.failure = loop.create_future()
        return loop.create_task(self.run(), name="agent-dispatcher")

    async def run(self) -> None:
        """Dispatch groups until cancelled."""
        while True:
            await self.slots.acquire(self.redundant_group_size)
            try:
                eid, version = await self._reserve()
            except BaseException:
                self.slots.release(self.redundant_group_size)
                raise
            self._start_group(eid, version)

    async def _reserve(self) -> tuple[Hashable, int]:
        """Reserve at the oldest instance version; if it is too old, wait for the instances to sync."""
        while True:
            version = self.pool.min_version()
            reserve = asyncio.ensure_future(self.manager.reserve(version))
            newer = asyncio.ensure_future(self.pool.wait_version_above(version))
            try:
                # A newer version reserves into a later buffer: do not keep waiting at the old one.
                await asyncio.wait({reserve, newer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                newer.cancel()
                if not reserve.done():
                    reserve.cancel()
            if not reserve.done() or reserve.cancelled():
                continue
            try:
                return reserve.result(), version
            except StaleVersionError:
                await self.pool.wait_version_above(version)

    def _start_group(self, eid: Hashable, version: int) -> None:
        prompt = self.task.sample_prompt(self.rng)
        g = Group(eid, f"g{self.next_group}", prompt, version, seed=stream_seed(self.seed, self.next_group))
        self.next_group += 1
        self.counts.groups += 1
        self.groups[eid] = g
        for _ in range(self.redundant_group_size):
            self._launch(g)

    def _launch(self, g: Group) -> Member:
        """Start one member on an agent worker (its slot is already taken)."""
        m = Member(g.next_idx, f"{g.uid}-{g.next_idx}")
        g.next_idx += 1
        g.members[m.idx] = m
        rng = random.Random(self.rng.getrandbits(64))
        m.task = asyncio.get_running_loop().create_task(self._member(g, m, rng), name=m.uid)
        m.task.add_done_callback(functools.partial(self._member_finished, g, m))
        return m

    # ------------------------------------------------------------------ one member

    async def _member(self, g: Group, m: Member, rng: random.Random) -> None:
        m.started = asyncio.get_running_loop().time()
        seed = None if g.seed is None else stream_seed(g.seed, m.idx)
        m.session = session = Session(self.pool, g.version, g.prompt.ids, group=g.uid, seed=seed)
        episode = await self._retried(g, m, "episode", lambda: self.task.run_episode(g.prompt, session.generate, rng))
        if episode is None:
            return
        reward = await self._reward(g, m, episode)
        if reward is not None:
            self._complete(g, m, self._trajectory(g, m, episode, reward))

    def _member_finished(self, g: Group, m: Member, task: asyncio.Task) -> None:
        """Runs for every member however it ended (even if cancelled before it started)."""
        m.done = True
        if m.session is not None:
            m.session.close()
        g.members.pop(m.idx, None)
        if not m.keep_slot:
            self.slots.release(1)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("agent worker %s crashed: %r", m.uid, exc)
            if self.failure is not None and not self.failure.done():
                err = (
                    exc
                    if isinstance(exc, PsrlError)
                    else RunError(
                        f"trajectory {m.uid} (group {g.uid})",
                        f"its agent worker crashed: {describe(exc)}",
                        "set PSRL_DEBUG=1 for the traceback",
                    )
                )
                if err is not exc:  # a psrl error is reported as is (a cause pointing at itself is a cycle)
                    err.__cause__ = exc
                self.failure.set_exception(err)

    async def _retried(
        self, g: Group, m: Member, stage: str, attempt: Callable[[], Awaitable[_T]], episode: Episode | None = None
    ) -> _T | None:
        """``await attempt()``, retried ``task.reward_retries`` times when it raises; None once reported failed."""
        for n in range(1 + self.retries):
            try:
                return await attempt()
            except Exception as err:  # CancelledError is a BaseException: it passes through
                if n < self.retries:
                    self.counts.error_retries += 1
                else:
                    self._fail(g, m, stage, err, episode)
        return None

    async def _reward(self, g: Group, m: Member, episode: Episode) -> dict | None:
        """The task's reward (sync or async), retrying a raising, hanging or non-finite reward; None once
        reported as failed."""
        return await self._retried(g, m, "reward", lambda: self.reward(g.prompt, episode), episode)

    def _trajectory(self, g: Group, m: Member, episode: Episode, reward: dict) -> Trajectory:
        s = m.session
        return episode_to_trajectory(
            g.prompt,
            episode,
            reward,
            uid=m.uid,
            group=g.uid,
            v_traj=s.v_traj if s is not None else g.version,
            instances=list(s.instances) if s is not None else [],
            gen_seconds=asyncio.get_running_loop().time() - m.started,
        )

    # ------------------------------------------------------------------ statuses

    def _complete(self, g: Group, m: Member, traj: Trajectory) -> None:
        """Hand one trajectory to the manager and act on the status it returns."""
        m.done = True  # no longer generating: filters must not cancel or replace it
        self.failed_in_a_row = 0
        held, occupied = self.manager.entry_members(g.eid), self.manager.entry_buffer(g.eid) is not None
        res = self.manager.complete(g.eid, traj, traj.v_traj)
        self.counts.generated += 1
        status = res.status
        if status == Status.OCCUPIED:
            self._cancel_members(g, keep=m)
        elif status == Status.REJECTED or (status == Status.SURPLUS and occupied):
            # the entry had ended, or is occupied already: this one trajectory is not stored
            self._record(traj, str(status))
            setattr(self.counts, str(status), getattr(self.counts, str(status)) + 1)
            if status == Status.REJECTED:
                self._end_group(g, str(status), keep=m)
        elif status != Status.PENDING:  # filtered, or surplus with no buffer left: the entry ended with these
            self._end_group(g, str(status), keep=m, held=held + [traj])
        self.after_change()

    def _end_group(
        self, g: Group, status: str, abort: bool = False, keep: Member | None = None, held: Sequence[Trajectory] = ()
    ) -> None:
        """Forget a group that will not be trained: record what its entry held (``held``, or, for an abort, what
        the manager holds now), cancel what runs."""
        if self.groups.pop(g.eid, None) is None:
            return
        if abort:
            held = self.manager.entry_members(g.eid)
            if self.manager.abort(g.eid):
                self.counts.aborted += 1
        for traj in held:
            self._record(traj, status)
            if status in ("surplus", "filtered"):
                setattr(self.counts, status, getattr(self.counts, status) + 1)
        self._cancel_members(g, keep=keep)

    def _cancel_members(self, g: Group, keep: Member | None = None) -> None:
        for m in g.live():
            if m is not keep:
                m.cancel()
                self.counts.cancelled += 1

    def _fail(self, g: Group, m: Member, stage: str, err: BaseException, episode: Episode | None = None) -> None:
        """Report a member whose episode or reward kept raising; abort the entry if the group cannot fill."""
        m.done = True
        self.counts.failed += 1
        log.warning("trajectory %s failed in %s after %d retries: %r", m.uid, stage, self.retries, err)
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.max_failed_in_a_row and self.failure is not None and not self.failure.done():
            what = "reward function" if stage == "reward" else "agent loop (run_episode)"
            self.failure.set_exception(
                RunError(
                    f"task {type(self.task).__name__} {what}",
                    f"the last {self.failed_in_a_row} trajectories all failed; last one {m.uid}: {describe(err)}",
                    "fix the task (trajectories.jsonl has every failure with status 'error'); PSRL_DEBUG=1 logs more",
                )
            )
        rec = {
            "uid": m.uid,
            "group": g.uid,
            "v_traj": m.session.v_traj if m.session else g.version,
            "segment_versions": [],
            "instances": list(m.session.instances) if m.session else [],
            "status": "error",
            "error": f"{stage}: {err!r}",
            "prompt": getattr(g.prompt, "text", ""),
        }
        if episode is not None:
            rec["segment_versions"] = segment_versions(episode.token_versions)
        self._emit(rec)
        if g.eid in self.groups and self.manager.entry_buffer(g.eid) is None:
            others = [x for x in g.live() if x is not m]
            if len(self.manager.entry_members(g.eid)) + len(others) < self.group_size:
                self._end_group(g, "aborted", abort=True)
                self.after_change()

    def after_change(self) -> None:
        """The protocol state (or the trainer's: it began waiting) changed: cancel passively aborted work, then run
        the proactive filter."""
        for eid, held in self.manager.drain_aborted_groups():
            g = self.groups.get(eid)
            if g is not None:
                self.counts.aborted += 1
                self._end_group(g, "aborted", held=held)
        self.proactive.check()

    def after_consume(self, batch: Batch) -> None:
        """The batch's groups leave the rollout side (recorded by :meth:`record_batch` once the step is done)."""
        for eid in batch.entries:
            self.groups.pop(eid, None)
        self.after_change()

    def record_batch(self, batch: Batch, skipped: str | None = None) -> None:
        """Record a consumed batch's trajectories: ``trained``, or ``skipped`` with the reason when the
        trainer skipped the step (NaN / infinite loss or gradient)."""
        for trajs in batch.groups:
            for traj in trajs:
                if skipped is None:
                    self._record(traj, "trained", consumed_version=batch.version)
                    self.counts.trained += 1
                else:
                    self._emit(trajectory_record(traj, "skipped", reason=skipped))
                    self.counts.skipped += 1

    # ------------------------------------------------------------------ status

    def in_flight(self) -> list[InFlight]:
        """Every trajectory being generated now (the stall watchdog's report)."""
        now = asyncio.get_running_loop().time()
        return [
            InFlight(
                m.uid,
                str(g.eid),
                m.session.instance.index if m.session is not None else -1,
                now - m.started,
                m.session is not None and m.session.in_model_turn,
            )
            for g in self.groups.values()
            for m in g.live()
        ]

    # ------------------------------------------------------------------ records and shutdown

    def _record(self, traj: Trajectory, status: str, consumed_version: int | None = None) -> None:
        self._emit(trajectory_record(traj, status, consumed_version))

    def _emit(self, rec: dict) -> None:
        if self.sink is not None:
            self.sink.trajectory(rec)

    async def shutdown(self, record_held: bool = True) -> None:
        """Cancel every member and wait for them; record still-held trajectories as ``held``."""
        tasks = [m.task for g in self.groups.values() for m in g.members.values() if m.task is not None]
        tasks += list(self._deferred)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if record_held:
            for g in self.groups.values():
                for traj in self.manager.entry_members(g.eid):
                    self._record(traj, "held")
            for traj in self._restored_held():
                self._record(traj, "held")

    def _restored_held(self) -> list:
        """Trajectories the staleness manager holds for entries this manager never launched: groups a resumed
        run restored from its checkpoint and has not trained yet (without this they would end unrecorded)."""
        held: list = []
        for reserved, occupied in self.manager.snapshot()["buffers"].values():
            for entry in map(SnapshotEntry._make, reserved + occupied):
                if entry.id not in self.groups:
                    held += entry.members
        return held

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue the prompt stream and the counters."""
        from dataclasses import asdict

        return {
            "rng": self.rng.getstate(),
            "counts": asdict(self.counts),
            "next_group": self.next_group,
            "task": self.task.state_dict() if hasattr(self.task, "state_dict") else {},
        }

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        if state.get("task") and hasattr(self.task, "load_state_dict"):
            self.task.load_state_dict(state["task"])  # a dataset continues its epoch
        self.counts = Counts(**state["counts"])
        self.next_group = int(state["next_group"])
