"""Failures that only appear during a run stop it with psrl's RunError naming their cause (issue #15):
a reward function or agent loop that fails every trajectory (instead of retrying groups forever), and
an agent worker that crashes (the trajectory it was running)."""

from __future__ import annotations

import pytest

from psrl.errors import RunError
from psrl.rollout.client.agents import AgentManager
from psrl.rollout.fakes import FakeTask
from tests.rollout.harness import config, coordinator, run


@pytest.mark.parametrize("stage, what", [("reward", "reward function"), ("episode", "agent loop (run_episode)")])
def test_a_task_that_fails_every_trajectory_stops_the_run_naming_it(stage, what):
    def fail(*_):
        raise ZeroDivisionError("broken")

    task = FakeTask(reward_fn=fail) if stage == "reward" else FakeTask(episode_fn=fail)
    coord = coordinator(config(), task)
    with pytest.raises(RunError) as e:
        run(coord, 2)
    msg = str(e.value)
    assert e.value.source == f"task FakeTask {what}" and "ZeroDivisionError: broken" in msg and "\n" not in msg
    assert coord.agents.counts.failed == coord.agents.max_failed_in_a_row


def test_one_failing_prompt_among_good_ones_does_not_stop_the_run():
    """The guard counts failures in a row: a task that fails sometimes trains on."""

    def reward(prompt, episode):
        if prompt.answer % 3 == 0:
            raise ValueError("flaky")
        return {"score": 1.0, "acc": 1.0, "seq_reward": 1.0, "seq_final_reward": 1.0}

    rows = run(coordinator(config(), FakeTask(reward_fn=reward)), 4)
    assert len(rows) == 4 and rows[-1]["counts/failed"] >= 1


def test_a_crashed_agent_worker_is_named_by_its_trajectory(monkeypatch):
    def crash(self, g, m, traj):
        raise KeyError("bookkeeping")

    monkeypatch.setattr(AgentManager, "_complete", crash)
    with pytest.raises(RunError) as e:
        run(coordinator(config(), FakeTask()), 1)
    assert e.value.source.startswith("trajectory g") and "KeyError: 'bookkeeping'" in str(e.value)
    assert isinstance(e.value.__cause__, KeyError)
