"""Checkpoints: a run stopped after its checkpoint resumes with no duplicated or lost steps or trajectories."""

import asyncio
from collections import Counter

import pytest

from psrl.rollout.fakes import FakeEngine, FakeTrainer
from psrl.runtime.checkpoint import resume, save_checkpoint
from psrl.runtime.local import publish_first_version, wire
from psrl.runtime.recorder import RunRecorder, read_jsonl
from psrl.runtime.vloop import run_virtual
from tests.rollout.harness import check_bound, config, run
from tests.runtime.test_coordinator_staleness import task


class SaveAt:
    """on_step hook: checkpoint after step ``k`` (the run then goes on, as a crashing run would)."""

    def __init__(self, k, run_dir, recorder, coord):
        self.k, self.run_dir, self.recorder, self.coord = k, run_dir, recorder, coord

    def __call__(self, row):
        if row["step"] == self.k:
            save_checkpoint(self.run_dir, self.coord, self.recorder)


def build(cfg, run_dir, trainer, log=None):
    rec = RunRecorder(run_dir)
    ck = resume(run_dir, trainer, rec)
    engines = [FakeEngine(token_cost=0.01) for _ in range(cfg.psrl.deployment.n_rollout_instances)]
    coord = wire(
        cfg,
        task(),
        trainer,
        engines,
        publish_first_version(cfg, trainer),
        ck["manager"] if ck else None,
        sink=rec,
        log=log or print,
    )
    if ck:
        coord.agents.load_state_dict(ck["agents"])
    return coord, rec, ck


def test_resume_from_checkpoint_has_each_step_once_and_no_duplicate_trajectory(tmp_path):
    """Checkpoint at step 3, run on to 5 ("crash"), resume to 8: steps 1..8 once each, uids unique, bound kept."""
    cfg = config(psrl__staleness=2)
    coord, rec, ck = build(cfg, tmp_path, FakeTrainer(train_time=0.5))
    assert ck is None
    run(coord, 5, SaveAt(3, tmp_path, rec, coord))
    rec.close()

    coord, rec, ck = build(cfg, tmp_path, FakeTrainer(train_time=0.5))
    assert ck is not None and coord.version == 3 and coord.manager.train_version == 3
    run(coord, 8)
    rec.close()

    steps = [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 9))
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    dup = [u for u, n in Counter(t["uid"] for t in trajs).items() if n > 1]
    assert not dup
    assert check_bound(trajs, 2) == 8 * 2 * 2
    assert sorted({t["consumed_version"] for t in trajs if t["status"] == "trained"}) == list(range(8))


def test_a_finished_run_resumes_to_more_steps_without_duplicates(tmp_path):
    """Checkpoint at the last step (as psrl train does), then resume: the same total trains nothing,
    a larger total continues; trajectories recorded ``held`` at the end are not recorded twice."""
    cfg = config(psrl__staleness=2, psrl__rollout_n=4)
    coord, rec, _ = build(cfg, tmp_path, FakeTrainer(train_time=3.0))
    run(coord, 3, SaveAt(3, tmp_path, rec, coord))
    rec.close()
    assert any(t["status"] == "held" for t in read_jsonl(tmp_path / "trajectories.jsonl"))
    coord, rec, _ = build(cfg, tmp_path, FakeTrainer())
    assert run(coord, 3) == [] and coord.version == 3
    rec.close()
    coord, rec, _ = build(cfg, tmp_path, FakeTrainer())
    run(coord, 5)
    rec.close()
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert not [u for u, n in Counter(t["uid"] for t in trajs).items() if n > 1]
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert check_bound(trajs, 2) == 5 * 2 * 4


class _StartsStep(FakeTrainer):
    """A FakeTrainer that sets ``started`` when the step producing version ``at`` begins."""

    def __init__(self, at, train_time):
        super().__init__(train_time=train_time)
        self.at, self.started = at, asyncio.Event()

    async def step(self, batch):
        if int(batch.version) + 1 == self.at:
            self.started.set()
        return await super().step(batch)


def _interrupt_during_step(coord, trainer, steps, cancels):
    """Run ``coord``, cancel it ``cancels`` times once ``trainer.started`` fires; returns the loop time."""

    async def main():
        run_task = asyncio.ensure_future(coord.run(steps))
        await trainer.started.wait()
        for _ in range(cancels):
            run_task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await run_task
        return asyncio.get_running_loop().time()

    return run_virtual(main())


def test_ctrl_c_during_a_step_finishes_it_and_leaves_a_resumable_run(tmp_path):
    """Cancelled while step 3 trains: step 3 completes, is published and recorded, and nothing is
    half-done (psrl train then checkpoints); resuming trains 4.. with no step or trajectory twice."""
    cfg = config(psrl__staleness=2)
    trainer = _StartsStep(at=3, train_time=2.0)
    said = []
    coord, rec, _ = build(cfg, tmp_path, trainer, log=said.append)
    _interrupt_during_step(coord, trainer, 10, cancels=1)
    assert coord.version == 3 and not coord.in_step and [r["step"] for r in coord.rows] == [1, 2, 3]
    assert said and "finishing training step 3" in said[0]
    save_checkpoint(tmp_path, coord, rec)  # what psrl train does when it is interrupted between steps
    rec.close()

    coord, rec, ck = build(cfg, tmp_path, FakeTrainer(train_time=0.5))
    assert ck is not None and coord.version == 3
    run(coord, 6)
    rec.close()
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert not [u for u, n in Counter(t["uid"] for t in trajs).items() if n > 1]
    assert check_bound(trajs, 2) == 6 * 2 * 2


def test_a_second_interrupt_stops_at_once(tmp_path):
    """Cancelled twice during step 3: the step is abandoned (version stays 2) long before it would end,
    and the coordinator still reports being in a step (psrl train then keeps the last periodic checkpoint)."""
    cfg = config(psrl__staleness=2)
    trainer = _StartsStep(at=3, train_time=100.0)
    coord, rec, _ = build(cfg, tmp_path, trainer, log=lambda _: None)
    t_end = _interrupt_during_step(coord, trainer, 10, cancels=2)
    rec.close()
    assert coord.version == 2 and [r["step"] for r in coord.rows] == [1, 2] and coord.in_step
    assert t_end < trainer.intervals[-1][1] + 100.0  # did not wait for the 100 s step


class _CrashesAt(FakeTrainer):
    def __init__(self, at):
        super().__init__(train_time=0.5)
        self.at = at

    async def step(self, batch):
        if int(batch.version) + 1 == self.at:
            raise RuntimeError("trainer crashed")
        return await super().step(batch)


def test_a_crash_inside_a_step_is_not_taken_for_a_consistent_state(tmp_path):
    """The trainer raises during step 3: the error propagates and the coordinator still says it is
    in a step, so psrl train does not checkpoint a consumed but untrained batch."""
    coord, rec, _ = build(config(psrl__staleness=2), tmp_path, _CrashesAt(3))
    with pytest.raises(RuntimeError, match="trainer crashed"):
        run(coord, 6)
    rec.close()
    assert coord.in_step and coord.version == 2 and coord.manager.train_version == 3
