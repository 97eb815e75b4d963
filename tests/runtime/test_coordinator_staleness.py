"""The coordinator end to end on fakes: the staleness bound read back from ``trajectories.jsonl``.

Workload: 3-turn episodes with heavy-tailed (lognormal, sigma 1.5) tool latency keyed by the
episode number, so every configuration sees the same draws and the runs are deterministic.
"""

import random

import pytest

from psrl.rollout.fakes import FakeTask
from psrl.runtime.recorder import RunRecorder, read_jsonl
from tests.rollout.harness import check_bound, config, coordinator, run


def heavy_tail(prompt, episode_no, call):
    return random.Random(episode_no * 7919 + call).lognormvariate(0.0, 1.5)


def task():
    return FakeTask(turns=3, turn_tokens=4, latency_fn=heavy_tail)


def run_to_dir(tmp_path, cfg, steps, **kw):
    rec = RunRecorder(tmp_path)
    coord = coordinator(cfg, task(), sink=rec, **kw)
    rows = run(coord, steps)
    rec.close()
    return coord, rows, read_jsonl(tmp_path / "trajectories.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_every_trained_trajectory_is_within_the_bound(tmp_path, eta, partial):
    """consumed_version - v_traj <= eta and min(segment_versions) >= v_traj for every trained line."""
    cfg = config(psrl__staleness=eta, psrl__partial_rollout__enable=partial)
    coord, rows, trajs, metrics = run_to_dir(tmp_path, cfg, 8)
    assert check_bound(trajs, eta) == 8 * 2 * 2
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert max(m["staleness/max"] for m in metrics) <= eta
    if eta > 0:
        assert max(m["staleness/max"] for m in metrics) >= 1, "an asynchronous run should use its window"


@pytest.mark.parametrize("eta", [1, 2])
def test_bound_holds_with_redundancy_migration_and_request_num_sync(tmp_path, eta):
    """B' > B, N' > N, partial rollout with migration, request_num sync: still within the bound, work cancelled."""
    cfg = config(
        psrl__staleness=eta,
        psrl__redundant_rollout__enable=True,
        psrl__redundant_rollout__redundant_global_batch_size=3,
        psrl__redundant_rollout__redundant_rollout_n=3,
        psrl__partial_rollout__enable=True,
        psrl__partial_rollout__interrupt_as_prompt=True,
        psrl__sync_and_mig_strategy__method="status_based",
        psrl__sync_and_mig_strategy__sync__threshold=3,
        psrl__routing_strategy__method="round_robin",
    )
    coord, rows, trajs, metrics = run_to_dir(tmp_path, cfg, 8, sync_cost=0.3)
    assert check_bound(trajs, eta) == 8 * 2 * 2
    assert metrics[-1]["counts/cancelled"] > 0
    uids = [t["uid"] for t in trajs]
    assert len(uids) == len(set(uids))
    assert sum(t["status"] != "error" for t in trajs) == coord.agents.counts.generated


def test_partial_rollout_produces_multi_version_segments(tmp_path):
    """With partial rollout and long turns some trajectories span versions, each segment >= V_traj."""
    cfg = config(psrl__staleness=2, psrl__partial_rollout__enable=True)
    rec = RunRecorder(tmp_path)
    coord = coordinator(cfg, FakeTask(turns=3, turn_tokens=30, latency_fn=heavy_tail), sink=rec, train_time=0.2)
    run(coord, 8)
    rec.close()
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    check_bound(trajs, 2)
    assert any(len(t["segment_versions"]) > 1 for t in trajs if t["status"] == "trained")


def _overlaps(times, intervals):
    return sum(1 for t in times for (a, b) in intervals if a < t < b)


def test_staleness_zero_is_synchronous_training(tmp_path):
    """eta=0: every trajectory is trained at its own version and no decode step runs while training."""
    cfg = config(psrl__staleness=0)
    coord, rows, trajs, _ = run_to_dir(tmp_path, cfg, 5, record=True)
    trained = [t for t in trajs if t["status"] == "trained"]
    assert trained and all(
        t["consumed_version"] == t["v_traj"] and t["segment_versions"] == [t["v_traj"]] for t in trained
    )
    times = [t for inst in coord.pool.instances for t in inst.model.times]
    assert _overlaps(times, coord.trainer.intervals) == 0


def test_positive_staleness_generates_while_training_and_is_faster(tmp_path):
    """eta=2 overlaps decoding with training and needs less (virtual) time per step than eta=0."""
    seconds = {}
    for eta in (0, 2):
        coord, rows, _, _ = run_to_dir(tmp_path / str(eta), config(psrl__staleness=eta), 8, record=True, train_time=2.0)
        seconds[eta] = rows[-1]["time"] / len(rows)
        times = [t for inst in coord.pool.instances for t in inst.model.times]
        overlap = _overlaps(times, coord.trainer.intervals)
        assert (overlap > 0) is (eta > 0)
    assert seconds[2] < 0.75 * seconds[0]


def test_the_adaptive_controller_raises_the_bound_while_the_trainer_waits_and_the_bound_holds(tmp_path):
    """psrl.adaptive_staleness on fakes (the trainer idles, no divergence measured): the bound starts at start (0) and
    rises one per window to the ceiling, not from a window holding one of the b rows after a move from b (they may
    still train data reserved under b); every step trains data reserved under a bound already in force."""
    cfg = config(
        psrl__staleness=3,
        psrl__adaptive_staleness__enable=True,
        psrl__adaptive_staleness__min=0,
        psrl__adaptive_staleness__start=0,
        psrl__adaptive_staleness__every=2,
        psrl__adaptive_staleness__idle_frac=0.05,
    )
    moves: list = []
    coord, rows, trajs, metrics = run_to_dir(tmp_path, cfg, 12, on_bound=moves.append)
    bounds = [m["staleness/bound"] for m in metrics]
    assert bounds[0] == 0 and bounds[-1] == 3
    # what events.jsonl hears: windows 1-2, 3-4, then 7-8 (5-6 holds step 5, after the move from 1)
    assert [(m.step, m.old, m.new) for m in moves] == [(2, 0, 1), (4, 1, 2), (8, 2, 3)]
    assert all(b - a in (0, 1) for a, b in zip(bounds, bounds[1:]))
    assert [i + 1 for i in range(len(bounds) - 1) if bounds[i + 1] != bounds[i]] == [2, 4, 8]  # one move per window
    for i, m in enumerate(metrics):  # step i+1 trains data reserved before it ended: under a bound of rows < i
        assert m["staleness/max"] <= max([0] + bounds[:i])
    assert check_bound(trajs, 3) == 12 * 2 * 2
    assert coord.state_dict()["adaptive"]["bound"] == 3 == coord.manager.staleness


def test_without_the_controller_the_bound_is_psrl_staleness_in_every_row(tmp_path):
    coord, rows, trajs, metrics = run_to_dir(tmp_path, config(psrl__staleness=2), 4)
    assert [m["staleness/bound"] for m in metrics] == [2] * 4 and "adaptive" not in coord.state_dict()
