"""What a consumed batch was (``reward/*``, ``batch/*``, ``staleness/*``): computed once, by the coordinator."""

import pytest

from psrl.runtime.coordinator import batch_metrics
from psrl.types import Trajectory


def _traj(v_traj, reward, mask, truncated=False, acc=None):
    return Trajectory(
        uid="u",
        group="g",
        v_traj=v_traj,
        prompt_ids=[1],
        response_ids=list(range(len(mask))),
        logprobs=[0.0] * len(mask),
        loss_mask=mask,
        reward=reward,
        truncated=truncated,
        metrics={} if acc is None else {"acc": acc},
    )


def test_batch_metrics_by_hand():
    trajs = [_traj(3, 1.0, [1, 1, 0, 0], acc=1.0), _traj(5, 0.0, [1, 1], truncated=True), _traj(4, 0.5, [1, 0])]
    m = batch_metrics(5, trajs)
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/std"] == pytest.approx((1 / 6) ** 0.5)
    assert m["reward/acc"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert (
        m["batch/trajectories"] == 3
        and "batch/sequences" not in m
        and m["batch/response_len_mean"] == pytest.approx(8 / 3)
    )
    assert m["batch/masked_frac"] == pytest.approx(3 / 8) and m["batch/truncated_frac"] == pytest.approx(1 / 3)
    assert m["staleness/mean"] == pytest.approx(1.0) and m["staleness/max"] == 2


def test_a_split_trajectory_counts_once_and_its_sequences_as_rows():
    """An agent episode split under task.agent_history=split: one trajectory (reward, lag, fractions per
    trajectory), two sequences (batch/sequences), lengths and the masked fraction over both."""
    from psrl.types import TokenSequence

    split = _traj(3, 1.0, [1, 1, 0, 0])
    split.earlier = (TokenSequence([1], [7, 7], [0.0, 0.0], [1, 0]),)
    m = batch_metrics(5, [split, _traj(5, 0.0, [1, 1])])
    assert m["batch/trajectories"] == 2 and m["batch/sequences"] == 3
    assert m["batch/response_len_mean"] == pytest.approx(8 / 2) and m["batch/masked_frac"] == pytest.approx(3 / 8)
    assert m["reward/mean"] == pytest.approx(0.5) and m["staleness/mean"] == pytest.approx(1.0)
