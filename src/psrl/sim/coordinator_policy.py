"""The ``coordinator`` policy: the real asynchronous coordinator of ``psrl train``, in simulated time.

The ``psrl`` policy (:mod:`psrl.sim.psrl_policy`) drives the real
:class:`~psrl.staleness.StalenessManager` from the simulator's own event heap; it is fast (a
million trajectories in seconds) but its dispatcher is a model of ``psrl train``'s. This policy
runs the production code itself -- :class:`~psrl.runtime.coordinator.Coordinator`, its agent
manager, rollout instance, router, sync strategy and proactive filter -- on the virtual-time
event loop (:mod:`psrl.runtime.vloop`), with three stand-ins:

* the task's episode decodes one token (zero cost) and then spends the trajectory's generation
  time, the next value of the workload's stream, as virtual seconds (so the i-th started
  trajectory takes the same time as the i-th launch of every other policy);
* the trainer's step takes ``train_time`` (+ the per-token part) virtual seconds;
* one rollout instance with ``slots`` agent workers; loading weights costs ``sync_time``.

With ``sim.decode.enable`` the episode instead *decodes* its tokens (generation time x
``sim.gen_tokens_per_second``) on ``psrl.deployment.n_rollout_instances`` fake engines routed by
``psrl.routing_strategy`` (``slots`` agent workers spread over them). A decode step over ``n`` running
requests takes ``(step_time + n * row_time) / speed``: an instance's throughput grows with its batch
while each request slows, so where the router puts a request, and which waiting request an instance
takes next (the multi-level queue, when ``sim.decode.max_running`` makes requests wait), change the
answer.

Nothing of the dispatch, the protocol calls or the cancellation logic is re-implemented, so a
difference between ``psrl`` and ``coordinator`` on the same workload is a difference between
the simulator's model and the real code. It costs about 0.1 ms of real time per trajectory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

from psrl.rollout.fakes import FakeEngine, FakeTrainer
from psrl.sim.divergence import StepLog
from psrl.sim.metrics import Recorder, Result, warmup_steps
from psrl.sim.workload import Workload
from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt, Task

__all__ = ["CoordinatorPolicy", "coordinator_config"]


def coordinator_config(wl: Workload) -> Any:
    """The ``psrl train`` config of a workload: its ``psrl.*`` keys, one instance with ``slots`` workers."""
    from psrl.config import load_config

    items = {
        "psrl.staleness": wl.staleness,
        "psrl.staleness_buffer_entries": wl.batch_size,
        "psrl.rollout_n": wl.group_size,
        "psrl.redundant_rollout.enable": "true",
        "psrl.redundant_rollout.redundant_global_batch_size": wl.redundant_batch_size,
        "psrl.redundant_rollout.redundant_rollout_n": wl.redundant_group_size,
        "psrl.deployment.n_rollout_instances": 1,
        "psrl.routing_strategy.max_concurrent_seqs_per_instance": wl.slots,
        "psrl.proactive_filter_strategy.method": wl.proactive_method or "null",
        "psrl.proactive_filter_strategy.threshold": wl.proactive_threshold,
        "psrl.proactive_filter_strategy.scope": wl.proactive_scope,
        "trainer.seed": wl.seed,
    }
    if wl.adaptive.enable:  # psrl train's controller, fed the sim.divergence figures of the step rows
        a = wl.adaptive  # every key of the section, so that a new one reaches the coordinator too
        for f in dataclasses.fields(a):
            v = getattr(a, f.name)
            items[f"psrl.adaptive_staleness.{f.name}"] = str(v).lower() if isinstance(v, bool) else v
    if wl.proactive_scope == "head":  # grace is head scope's (the config rejects it with window, where it is moot)
        items["psrl.proactive_filter_strategy.grace"] = wl.proactive_grace
    if wl.decode:
        items["psrl.deployment.n_rollout_instances"] = wl.instances
        items["psrl.routing_strategy.max_concurrent_seqs_per_instance"] = -(-wl.slots // wl.instances)
        items["trainer.max_new_tokens"] = 10**9  # a trajectory is as long as the stream says
        items.update(
            {k: ("null" if v is None else str(v).lower() if isinstance(v, bool) else v) for k, v in wl.routing}
        )
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


class _Meter:
    """Per-trajectory bookkeeping shared by the stand-in task, trainer and sink."""

    def __init__(self, wl: Workload):
        self.wl = wl
        self.rec = Recorder(wl.slots, wl.staleness)
        self.stream = wl.gen_stream()
        self.drawn: dict[str, float] = {}  # member uid -> its full generation time
        self.cut: dict[str, float] = {}  # member uid -> seconds it ran before it was cancelled
        self.recorded: set[str] = set()
        self.running = 0
        self.busy = 0.0  # integral of running generations over time
        self.last = 0.0
        self.finished = False
        self.log = StepLog()

    def tick(self, now: float, delta: int) -> None:
        self.busy += self.running * (now - self.last)
        self.last = now
        self.running += delta


class _SimTask(Task):
    """A task whose episode takes the stream's next generation time (a virtual-time sleep)."""

    stop_ids: set[int] = set()
    max_context = 10**9

    def __init__(self, meter: _Meter):
        self.meter = meter
        self.prompts = 0

    def sample_prompt(self, rng: random.Random) -> Prompt:
        n = self.prompts
        self.prompts += 1
        return Prompt(uid=f"p{n}", ids=[1, 2, 3], answer=n)

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        meter = self.meter
        this = asyncio.current_task()
        assert this is not None, "a coroutine runs in a task"
        uid = this.get_name()  # the agent manager names a member's task by its uid
        d = meter.stream.next()
        meter.drawn[uid] = d
        loop = asyncio.get_running_loop()
        start = loop.time()
        meter.tick(start, +1)
        try:
            ep = Episode()
            if meter.wl.decode:
                ep.add_model(await generate(list(prompt.ids), max(1, round(d * meter.wl.tokens_per_second))))
                return ep
            ep.add_model(await generate(list(prompt.ids), 1))
            await asyncio.sleep(max(0.0, d - (loop.time() - start)))
            return ep
        except asyncio.CancelledError:
            if not meter.finished:
                meter.cut[uid] = loop.time() - start
            raise
        finally:
            meter.tick(loop.time(), -1)

    def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        return {"score": 0.0, "acc": 0.0, "seq_reward": 0.0, "seq_final_reward": 0.0}

    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        return []


class _SimTrainer(FakeTrainer):
    """``step`` takes the workload's training time in virtual seconds and records the step (the rest of the
    trainer protocol: :class:`~psrl.rollout.fakes.FakeTrainer`'s)."""

    def __init__(self, meter: _Meter):
        super().__init__(FakeEngine(token_cost=0.0), train_time=0.0)
        self.meter = meter

    async def step(self, batch: Any) -> dict:
        meter, wl = self.meter, self.meter.wl
        rec = meter.rec
        tokens = 0.0
        lags = [int(batch.version) - int(t.v_traj) for members in batch.groups for t in members]
        for members in batch.groups:
            for t in members:
                slot = t.gen_seconds if t.truncated else meter.drawn[t.uid]
                rec.trained(int(batch.version) - int(t.v_traj), meter.drawn[t.uid], slot)
                tokens += slot
        dur = wl.train_time + wl.train_time_per_token * tokens * wl.tokens_per_second
        if dur > 0:
            await asyncio.sleep(dur)
        loop = asyncio.get_running_loop()
        meter.tick(loop.time(), 0)
        rec.step_done(loop.time(), dur, meter.busy)
        if int(batch.version) + 1 >= wl.steps:
            meter.finished = True  # what shutdown cancels next is not the policy's doing
        return dict(wl.divergence.batch(lags))  # sim.divergence: the row's divergence/*, as the trainer reports


class _Sink:
    """Trajectory records: completed output thrown away counts as discarded (trained ones are
    counted by the trainer, which sees them first)."""

    def __init__(self, meter: _Meter):
        self.meter = meter

    def trajectory(self, rec: dict) -> None:
        meter = self.meter
        uid = rec["uid"]
        meter.recorded.add(uid)
        status = rec["status"]
        if status in ("trained", "held", "error") or meter.finished or uid not in meter.drawn:
            return
        slot = rec["gen_seconds"] if rec.get("truncated") else meter.drawn[uid]
        meter.rec.discarded(meter.drawn[uid], slot)

    def metric(self, row: dict) -> None:
        log = self.meter.log
        if log.rows and row.get("staleness/bound") != log.rows[-1].get("staleness/bound"):
            log.moves += 1
        log.add(row)


def _engines(wl: Workload) -> list:
    """One fake engine per rollout instance: free decoding, or the ``sim.decode`` speed model."""
    if not wl.decode:
        return [FakeEngine(token_cost=0.0, sync_cost=wl.sync_time)]
    speeds = wl.decode_speeds or (1.0,) * wl.instances
    return [
        FakeEngine(token_cost=wl.decode_row_time / v, step_cost=wl.decode_step_time / v, sync_cost=wl.sync_time)
        for v in speeds
    ]


class CoordinatorPolicy:
    """Runs the real :class:`~psrl.runtime.coordinator.Coordinator` on the workload, in virtual time."""

    name = "coordinator"

    def __init__(self, wl: Workload):
        self.wl = wl
        self.t_drawn: list[float] = []  # generation time of every launch, in launch order (after run)

    def run(self) -> Result:
        from psrl.runtime.coordinator import build_staleness_manager
        from psrl.runtime.local import build
        from psrl.runtime.vloop import run_virtual
        from psrl.staleness import StalenessManager

        wl = self.wl
        meter = _Meter(wl)
        cfg = coordinator_config(wl)
        if wl.filter_drop_rate > 0:
            draws: list[float] = []
            u = wl.filter_stream()

            def keep(trajs: list) -> bool:  # the same i-th-group draw as the other policies
                i = int(str(trajs[0].group).lstrip("g"))
                while len(draws) <= i:
                    draws.append(u.next())
                return draws[i] >= wl.filter_drop_rate

            sm = StalenessManager(
                wl.staleness,
                wl.batch_size,
                wl.group_size,
                wl.redundant_batch_size,
                wl.redundant_group_size,
                group_filter=keep,
            )
        else:
            sm = build_staleness_manager(cfg)
        coord = build(
            cfg,
            log=lambda _: None,
            task=_SimTask(meter),
            trainer=_SimTrainer(meter),
            engines=_engines(wl),
            sink=_Sink(meter),
            manager=sm,
        )
        if wl.decode and wl.decode_max_running is not None:
            for inst in coord.pool.instances:  # the engine's own batch limit (vLLM's max_num_seqs)
                inst.max_batch = wl.decode_max_running
        run_virtual(coord.run(wl.steps))
        for uid, ran in meter.cut.items():
            if uid not in meter.recorded:  # cancelled mid-generation (a truncated one was recorded)
                meter.rec.cancelled(meter.drawn[uid], ran)
        self.t_drawn = list(meter.drawn.values())
        name = f"{self.name}+adaptive" if wl.adaptive.enable else self.name
        res = meter.rec.result(name, wl.ideal_steps_per_hour(), len(meter.drawn))
        res.extra.update(meter.log.extra(warmup_steps(len(meter.log.rows))))
        return res
