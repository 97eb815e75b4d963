"""Checkpoints: a run stopped after its checkpoint resumes with no duplicated or lost steps or trajectories."""

from collections import Counter

from psrl.rollout.engine import FakeEngine
from psrl.rollout.fakes import FakeTrainer
from psrl.runtime.checkpoint import resume, save_checkpoint
from psrl.runtime.coordinator import Coordinator
from psrl.runtime.recorder import RunRecorder, read_jsonl
from tests.rollout.harness import check_bound, config, run
from tests.runtime.test_coordinator_staleness import task


class SaveAt:
    """on_step hook: checkpoint after step ``k`` (the run then goes on, as a crashing run would)."""

    def __init__(self, k, run_dir, recorder):
        self.k, self.run_dir, self.recorder = k, run_dir, recorder

    def __call__(self, coord, row):
        if row["step"] == self.k:
            save_checkpoint(self.run_dir, coord, self.recorder)


def build(cfg, run_dir, trainer):
    rec = RunRecorder(run_dir)
    ck = resume(run_dir, trainer, rec)
    engines = [FakeEngine(token_cost=0.01) for _ in range(cfg.psrl.num_rollout_instances)]
    coord = Coordinator(cfg, task(), trainer, engines, sink=rec, staleness=ck["manager"] if ck else None)
    if ck:
        coord.agents.load_state(ck["agents"])
    return coord, rec, ck


def test_resume_from_checkpoint_has_each_step_once_and_no_duplicate_trajectory(tmp_path):
    """Checkpoint at step 3, run on to 5 ("crash"), resume to 8: steps 1..8 once each, uids unique, bound kept."""
    cfg = config(psrl__staleness=2)
    coord, rec, ck = build(cfg, tmp_path, FakeTrainer(train_time=0.5))
    assert ck is None
    coord.on_step = SaveAt(3, tmp_path, rec)
    run(coord, 5)
    rec.close()

    coord, rec, ck = build(cfg, tmp_path, FakeTrainer(train_time=0.5))
    assert ck is not None and coord.version == 3 and coord.staleness.train_version == 3
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
    coord.on_step = SaveAt(3, tmp_path, rec)
    run(coord, 3)
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
