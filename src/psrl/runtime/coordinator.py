"""The asynchronous coordinator: generation and training at the same time, within ``psrl.staleness``.

The whole pipeline on one screen::

    instances (token-level batching, sync strategy)  <--- psrl.weights  <---+
        ^                                                                   |
        | route / migrate                                                   | publish T+1
    agent manager: slots -> await reserve(v) -> N' members -> complete()   |
        |                                                                   |
        v                                                                   |
    StalenessManager  --- await next_batch() --->  trainer.step (thread) ---+

The trainer loop never waits for generation except through ``next_batch`` (buffer ``T`` READY),
and generation never waits for training except through ``reserve`` (back-pressure of the
protocol). ``trainer.step`` runs in a worker thread (or is awaited if it is a coroutine, as a
fake trainer's is), so tool calls and decoding go on while it trains. With ``staleness: 0``
no reservation is admitted between a consume and the publication of the next version, so the
same code trains synchronously.

Time comes only from the running event loop: ``asyncio.run`` in production, the virtual-time
loop of :mod:`psrl.runtime.vloop` in tests.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from psrl.algo.filters import build_group_filter
from psrl.errors import RunError
from psrl.rollout.client import AgentManager
from psrl.rollout.serving import InstancePool
from psrl.rollout.types import RolloutStatus, TrainerWaiting
from psrl.runtime.adaptive import Move, StalenessController
from psrl.runtime.watchdog import Watchdog
from psrl.staleness import Batch, Event, StalenessManager
from psrl.types import Sink, StepTrainer, Trajectory, WeightSource

if TYPE_CHECKING:
    from psrl.config import Config

__all__ = ["Coordinator", "TrainerWait", "build_staleness_manager", "batch_metrics", "canonical_order"]


def build_staleness_manager(
    cfg: Config, train_version: int = 0, on_event: Callable[[Event], Any] | None = None
) -> StalenessManager:
    """The staleness manager of ``psrl.*`` (with its group filter) at ``train_version``; ``on_event`` hears every
    transition (``events.jsonl``)."""
    p = cfg.psrl
    return StalenessManager(
        p.staleness,
        p.batch_size,
        p.group_size,
        p.redundant_batch_size,
        p.redundant_group_size,
        group_filter=build_group_filter(p, cfg.algorithm),
        on_event=on_event,
        train_version=train_version,
        max_staleness=p.staleness,  # the ceiling; psrl.adaptive_staleness may run below it
    )


class TrainerWait:
    """The trainer loop's idle state (:class:`psrl.rollout.types.TrainerIdle`): the coordinator says when the
    trainer begins and ends waiting for buffer ``T``; the proactive filter's head scope reads it."""

    def __init__(self) -> None:
        self._waiting: TrainerWaiting | None = None

    def waiting(self) -> TrainerWaiting | None:
        """The buffer the trainer waits for and since when (loop time); None while it trains."""
        return self._waiting

    def begin(self, buffer: int, now: float) -> None:
        """The trainer waits for ``buffer`` from loop time ``now``."""
        self._waiting = TrainerWaiting(int(buffer), float(now))

    def end(self) -> None:
        """The trainer has its batch (or stopped waiting)."""
        self._waiting = None


class Coordinator:
    """Runs the trainer loop over the parts the run builder made and wired (:func:`psrl.runtime.local.wire`):
    the staleness manager, the rollout side (:func:`psrl.rollout.build_rollout`: instance pool and agent manager),
    the trainer and where its versions are published; it builds none of them.

    Args:
        cfg: the validated :class:`psrl.config.Config`.
        trainer: the :class:`~psrl.types.StepTrainer` (:class:`psrl.train.Trainer`, or a fake): ``step`` then
            ``publish`` per batch.
        weights: where the engines read published versions (:mod:`psrl.weights`), holding the trainer's current
            version: the trainer's ``out``, which its ``publish`` fills.
        manager: the staleness manager (fresh or restored).
        pool, agents: the rollout side over ``manager`` and ``weights``.
        idle: the trainer's wait, which this loop sets and the rollout side (the proactive filter) reads.
        controller: ``psrl.adaptive_staleness``'s controller over ``manager`` (None: off).
        sink: ``trajectory(record)`` / ``metric(row)`` (a RunRecorder or a MemorySink).
        log: where to say that a cancelled run is finishing its training step (default: print).
        on_bound: hears each move of ``psrl.adaptive_staleness``'s bound (``psrl train``: a line of
            ``events.jsonl``, :meth:`psrl.runtime.recorder.EventLog.bound`).

    Cancelling :meth:`run` (Ctrl-C) while a training step runs lets that step finish and be
    published and recorded before ``CancelledError`` propagates: the step cannot be interrupted
    (it runs in a thread), and finishing it leaves the run at a consistent, checkpointable state
    instead of one with a consumed but untrained batch. Cancelling again stops at once.
    """

    def __init__(
        self,
        cfg: Config,
        trainer: StepTrainer,
        weights: WeightSource,
        manager: StalenessManager,
        pool: InstancePool,
        agents: AgentManager,
        idle: TrainerWait,
        *,
        controller: StalenessController | None = None,
        sink: Sink | None = None,
        log: Callable[[str], None] | None = None,
        on_bound: Callable[[Move], Any] | None = None,
    ):
        self.cfg = cfg
        self.on_bound = on_bound
        self.log = log or print
        self.trainer = trainer
        self.sink = sink
        self.store = weights
        self.manager = manager
        self.controller = controller
        """``psrl.adaptive_staleness``: moves the bound of new reservations after the steps (None: off)."""
        self.idle = idle
        """Which buffer the trainer waits on and since when (the proactive filter's head scope reads it)."""
        self.pool, self.agents = pool, agents
        self.rows: list[dict] = []
        self.in_step = False
        self.watchdog: Watchdog | None = None
        self._t0 = 0.0
        self._last = 0.0
        self._synced: tuple[int, float] | None = None
        """The newest version every engine serves, and its ``time/sync_s``, not yet in a row."""
        self._sync_watch: asyncio.Task | None = None

    @property
    def version(self) -> int:
        """The trainer's version: this coordinator sets it (and publishes the weights) after every step."""
        return int(self.trainer.policy.version)

    def state_dict(self) -> dict:
        """What a checkpoint needs besides the trainer's own state: the version, the staleness manager's
        snapshot and the agent manager's state (a consistent cut only between steps: ``not in_step``)."""
        state = {"version": self.version, "staleness": self.manager.snapshot(), "agents": self.agents.state_dict()}
        if self.controller is not None:
            state["adaptive"] = self.controller.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue a checkpoint's agent manager and adaptive controller (the staleness manager is restored by
        :func:`psrl.runtime.checkpoint.resume` and given to the constructor)."""
        self.agents.load_state_dict(state["agents"])
        if self.controller is not None and "adaptive" in state:
            self.controller.load_state_dict(state["adaptive"])

    def status(self) -> RolloutStatus:
        """What the rollout side is doing now: its instances and the trajectories in flight (the stall report)."""
        return RolloutStatus(self.pool.status(), self.agents.in_flight())

    async def run(self, total_steps: int, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train until the trainer holds version ``total_steps``; returns one metrics row per step. ``on_step`` is
        called with each step's row once the step is published (psrl train: show, validate, checkpoint)."""
        loop = asyncio.get_running_loop()
        self.pool.start()
        try:
            await self.pool.ready()
        except BaseException:
            await self.pool.stop()  # an engine that could not start: the others (servers, Ray actors) end too
            raise
        self._t0 = self._last = loop.time()  # engine start-up (a vLLM server: tens of seconds) is not a step
        dispatcher = self.agents.start()
        watchdog = self._watchdog()
        finished = False
        try:
            while self.version < total_steps:
                self.idle.begin(self.manager.train_version, loop.time())
                self.agents.after_change()  # the trainer waits now: the proactive filter's head scope may act
                try:
                    batch = canonical_order(await self._next_batch(dispatcher))
                finally:
                    self.idle.end()
                await self._train_on(batch, on_step)
            finished = True
        finally:
            dispatcher.cancel()
            if self._sync_watch is not None:
                self._sync_watch.cancel()
            if watchdog is not None:
                watchdog.cancel()
            await asyncio.gather(dispatcher, *([watchdog] if watchdog else []), return_exceptions=True)
            await self.agents.shutdown(record_held=finished)
            await self.pool.stop()
        return self.rows

    def _watchdog(self) -> asyncio.Task | None:
        """The stall watchdog (``trainer.stall_timeout_s``; 0 = none): the bound on reserve / next_batch waits."""
        timeout = self.cfg.trainer.stall_timeout_s
        if timeout <= 0:
            return None
        self.watchdog = Watchdog(self, timeout, getattr(self.sink, "run_dir", None), self.log)
        return asyncio.get_running_loop().create_task(self.watchdog.run(), name="stall-watchdog")

    async def _next_batch(self, dispatcher: asyncio.Task) -> Batch:
        """``await next_batch()``, but fail fast if the dispatcher or an agent worker crashed."""
        nb = asyncio.ensure_future(self.manager.next_batch())
        failure = self.agents.failure
        assert failure is not None, "agents.start() (in run) made the failure future"
        watched: set[asyncio.Future[Any]] = {nb, dispatcher, failure}
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            nb.cancel()
            raise
        if nb in done:
            return nb.result()
        nb.cancel()
        for fut in done:
            fut.result()  # raises the crash
        raise RuntimeError("the agent dispatcher stopped")

    async def _train_on(self, batch: Batch, on_step: Callable[[dict], None] | None = None) -> None:
        """Record the batch, train on it (generation keeps going), publish ``T + 1``, wake instances."""
        loop = asyncio.get_running_loop()
        self.agents.after_consume(batch)
        started = loop.time()
        self.in_step = True  # stays True if the step fails or is abandoned: no checkpoint of a half-done step
        interrupted = False
        step = asyncio.ensure_future(self._step(batch))
        try:
            metrics = await asyncio.shield(step)
        except asyncio.CancelledError:
            interrupted = True
            if not step.done():
                self.log(
                    f"interrupted: finishing training step {int(batch.version) + 1} first (interrupt again to stop now)"
                )
                try:
                    await asyncio.wait([step])
                except asyncio.CancelledError:
                    step.cancel()
                    raise
            metrics = step.result()
        self.in_step = False
        skipped = self.trainer.last_skip
        self.agents.record_batch(batch, skipped)
        version = int(batch.version) + 1
        metrics = dict(metrics or {})
        step_end = loop.time()
        # off the loop: the engines keep being served while the version is written
        metrics.update(await asyncio.to_thread(self.trainer.publish, version))
        self._sync_watch = loop.create_task(self._time_sync(version, step_end), name=f"sync-v{version}")
        self.pool.notify_published()
        row = self._row(batch, metrics, loop.time() - started)
        if self.controller is not None:
            move = self.controller.observe(row)
            if move is not None:
                self.log(
                    f"staleness bound {move.old} -> {move.new} for new reservations after step {move.step}: "
                    f"{move.reason} (psrl.adaptive_staleness)"
                )
                if self.on_bound is not None:
                    self.on_bound(move)
        self.rows.append(row)
        if self.sink is not None:
            self.sink.metric(row)
        if on_step is not None:
            on_step(row)
        if skipped is not None:
            self._skipped(version, skipped)
        if interrupted:
            raise asyncio.CancelledError()

    async def _time_sync(self, version: int, step_end: float) -> None:
        """``time/sync_s`` of ``version``: from the end of its optimiser step until every live engine serves it (the
        engines load it when their sync strategy says; a later row reports it, see :meth:`_row`)."""
        await self.pool.wait_version_above(version - 1)
        self._synced = (version, asyncio.get_running_loop().time() - step_end)

    def _skipped(self, version: int, reason: str) -> None:
        """Say that step ``version`` was skipped; stop after ``trainer.max_skipped_steps`` in a row."""
        in_a_row = int(self.trainer.skipped_in_a_row)
        limit = self.cfg.trainer.max_skipped_steps
        self.log(
            f"step {version} skipped ({reason}): its trajectories are recorded 'skipped', "
            f"{in_a_row} in a row of trainer.max_skipped_steps={limit}"
        )
        if in_a_row >= limit:
            raise RunError(
                f"trainer at step {version}",
                f"{in_a_row} steps in a row skipped, the last: {reason}",
                "lower trainer.lr or trainer.grad_clip, or check the model's dtype and the rewards; "
                "the run is checkpointed here and the same command resumes it",
            )

    async def _step(self, batch: Batch) -> dict[str, float]:
        step = self.trainer.step
        if inspect.iscoroutinefunction(step):
            return await step(batch)
        metrics = await asyncio.to_thread(step, batch)
        if inspect.isawaitable(metrics):  # a coroutine step is an `async def` (StepTrainer), awaited above
            raise TypeError(f"{type(self.trainer).__name__}.step returned an awaitable: declare it `async def`")
        return metrics

    def _row(self, batch: Batch, metrics: dict, train_s: float) -> dict:
        """One ``metrics.jsonl`` line: progress, what the batch was, buffer states, counters, throughput, and the
        trainer's own metrics (names and owners: :mod:`psrl.metrics`)."""
        now = asyncio.get_running_loop().time()
        trajs = [t for g in batch.groups for t in g]
        elapsed = max(now - self._t0, 1e-9)
        row = {
            "step": int(batch.version) + 1,
            "version": int(batch.version) + 1,
            "time": round(elapsed, 6),
            "time/step_s": round(now - self._last, 6),
            "time/train_s": round(train_s, 6),
            **batch_metrics(int(batch.version), trajs),
            "staleness/bound": self.manager.staleness,
            "buffers": {str(b): str(s) for b, s in self.manager.buffer_states().items()},
            "instance_versions": self.pool.versions(),
            "throughput/trajectories_per_s": self.agents.counts.generated / elapsed,
        }
        self._last = now
        if self._synced is not None:  # measured once the engines loaded it: after its own row, so in a later one
            row["weights/synced_version"], row["time/sync_s"] = self._synced[0], round(self._synced[1], 6)
            self._synced = None
        row.update(self.agents.counts.as_metrics())
        row.update({f"staleness/{k}": v for k, v in self.manager.stats.as_dict().items() if isinstance(v, int)})
        row.update(self.pool.stats())
        for k, v in metrics.items():
            row.setdefault(k, v)
        return row


def canonical_order(batch: Batch) -> Batch:
    """``batch`` with its groups in reservation order (entry ids, which the staleness manager hands out in
    increasing order) and each group's trajectories in member order (their uids, numbers compared as numbers).

    ``consume`` gives groups in occupy order and members in completion order, which is how the engines' timing
    happened to fall; the trainer sees this order instead, so a run whose trajectories do not depend on timing
    (a synchronous one, :attr:`psrl.types.GenRequest.seed`) trains on the same batch, summed in the same order,
    however busy the machine was. The staleness manager's own order is left as its spec says.
    """
    order = sorted(range(len(batch.groups)), key=lambda i: _natural(str(batch.entries[i])))
    return Batch(
        batch.version,
        [sorted(batch.groups[i], key=lambda t: _natural(str(getattr(t, "uid", "")))) for i in order],
        [batch.entries[i] for i in order],
        [batch.group_versions[i] for i in order],
    )


def _natural(text: str) -> tuple:
    """Sort key comparing the digit runs of ``text`` as numbers: ``g2-10`` after ``g2-9``, entry ``10`` after ``9``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def batch_metrics(version: int, trajs: Sequence[Trajectory]) -> dict[str, float]:
    """What a consumed batch was: reward, accuracy, lengths, masked (tool) and truncated fractions (and the fraction
    that called a tool, for tasks whose reward counts ``tool_calls``), and the
    measured lag ``version - V_traj`` (``staleness/*``). Lengths and the masked fraction count every training
    sequence of a trajectory (``batch/sequences``, the trainer's rows: only when some trajectory was split)."""
    n = max(len(trajs), 1)
    rewards = [float(t.reward) for t in trajs]
    mean = sum(rewards) / n
    rows = [r for t in trajs for r in t.rows()]
    tokens = sum(len(r.response_ids) for r in rows)
    lag = [int(version) - int(t.v_traj) for t in trajs]
    calls = {"batch/tool_call_frac": sum(t.metrics.get("tool_calls", 0.0) > 0 for t in trajs) / n}
    return {
        **(calls if any("tool_calls" in t.metrics for t in trajs) else {}),
        **({"batch/sequences": len(rows)} if len(rows) > len(trajs) else {}),
        "reward/mean": mean,
        "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "reward/acc": sum(float(t.metrics.get("acc", t.reward)) for t in trajs) / n,
        "batch/trajectories": len(trajs),
        "batch/response_len_mean": tokens / n,
        "batch/masked_frac": 1.0 - sum(sum(r.loss_mask) for r in rows) / max(tokens, 1),
        "batch/truncated_frac": sum(bool(t.truncated) for t in trajs) / n,
        "staleness/mean": sum(lag) / n,
        "staleness/max": max(lag, default=0),
    }
