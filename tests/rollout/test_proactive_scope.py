"""The proactive filter's scope in the real coordinator (virtual time): ``head`` truncates only the blockers of
buffer T, only while the trainer waits for it, and only after ``grace``; ``window`` acts on every STUCK buffer in
``[T, T + eta]`` whatever the trainer does (as before the key existed).

Every truncation is observed where it happens: a truncated member's reward is computed at once (the FakeTask's
reward is synchronous), so the reward function sees the coordinator's state at the moment of the cut.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from psrl.rollout.fakes import FakeTask
from psrl.runtime.coordinator import Coordinator
from tests.rollout.harness import check_bound, config, coordinator, run


def _heavy_tail(prompt, episode_no, call):
    return random.Random(episode_no * 7919 + call).lognormvariate(0.0, 1.5)


def _run(scope: str, grace: float = 0.0, steps: int = 12) -> tuple[Coordinator, list[dict], list[dict]]:
    """12 steps at eta 2 with a heavy-tailed tool latency and truncate at threshold 1; returns the coordinator,
    its rows, and one dict per truncated member: the buffer its entry was reserved in, T, the trainer's wait."""
    cuts: list[dict] = []
    holder: list[Coordinator] = []

    def reward(prompt, episode):
        if episode.truncated:
            coord = holder[0]
            sm = coord.manager
            (eid,) = [e for e, g in coord.agents.groups.items() if g.prompt is prompt]
            T = sm.train_version
            cuts.append(
                {
                    "in_T": eid in sm.blocking(T),
                    "in_window": any(eid in sm.blocking(b) for b in range(T, T + 3)),
                    "T": T,
                    "waiting": coord.idle.waiting(),
                    "now": asyncio.get_running_loop().time(),
                }
            )
        return {"score": 1.0, "acc": 1.0, "seq_reward": 1.0, "seq_final_reward": 1.0}

    overrides = {
        "psrl__staleness": 2,
        "psrl__proactive_filter_strategy__method": "truncate",
        "psrl__proactive_filter_strategy__threshold": 1,
        "psrl__proactive_filter_strategy__scope": scope,
    }
    if grace:
        overrides["psrl__proactive_filter_strategy__grace"] = grace
    cfg = config(**overrides)
    task = FakeTask(turns=3, turn_tokens=4, latency_fn=_heavy_tail, reward_fn=reward)
    coord = coordinator(cfg, task, train_time=0.5)
    holder.append(coord)
    rows = run(coord, steps)
    return coord, rows, cuts


@pytest.mark.parametrize("grace", [0.0, 0.75])
def test_head_scope_cuts_only_buffer_T_while_the_trainer_waits_for_it(grace):
    """Each cut member's group is a blocker of buffer T, the trainer is idle waiting for T, and has been for
    at least ``grace`` seconds; the bound still holds for every trained trajectory."""
    coord, rows, cuts = _run("head", grace)
    assert cuts, "the workload has stragglers: head scope should cut some"
    for c in cuts:
        assert c["in_T"], c
        assert c["waiting"] is not None and c["waiting"].buffer == c["T"], c
        assert c["now"] >= c["waiting"].since + grace - 1e-9, c
    if grace:
        assert any(c["now"] > c["waiting"].since for c in cuts), "some cut waited for its grace timer"
    assert rows[-1]["counts/truncated"] == coord.agents.counts.truncated == len(cuts)
    assert max(r["staleness/max"] for r in rows) <= 2


def test_window_scope_also_cuts_later_buffers_and_while_the_trainer_trains():
    """The same workload with scope window (the default): cuts in T + 1 .. T + eta or while the trainer trains,
    which head scope never makes -- so the observation above can tell the scopes apart."""
    _, rows, cuts = _run("window")
    assert cuts and all(c["in_window"] for c in cuts)
    assert any(not c["in_T"] or c["waiting"] is None for c in cuts), cuts
    assert max(r["staleness/max"] for r in rows) <= 2


def test_window_is_the_default_and_head_without_a_method_does_nothing():
    """scope window is what the filter did before the key; head needs a method to act at all."""
    cfg = config()
    assert (cfg.psrl.proactive_filter_strategy.scope, cfg.psrl.proactive_filter_strategy.grace) == ("window", 0.0)
    coord = coordinator(config(psrl__proactive_filter_strategy__scope="head"), FakeTask(turns=2))
    rows = run(coord, 3)
    assert rows[-1]["counts/truncated"] == 0 and rows[-1]["counts/retried"] == 0
    assert coord.idle.waiting() is None  # the run ended with its batch in hand


def test_records_of_a_head_scope_run_keep_the_bound(tmp_path):
    """The staleness audit of the trajectory records holds with head scope (cut members included)."""
    from psrl.runtime.recorder import RunRecorder, read_jsonl

    rec = RunRecorder(tmp_path)
    cfg = config(
        psrl__staleness=1,
        psrl__proactive_filter_strategy__method="truncate",
        psrl__proactive_filter_strategy__threshold=1,
        psrl__proactive_filter_strategy__scope="head",
    )
    coord = coordinator(cfg, FakeTask(turns=3, turn_tokens=4, latency_fn=_heavy_tail), sink=rec)
    run(coord, 8)
    rec.close()
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert check_bound(trajs, 1) == 8 * 2 * 2
    assert any(t["truncated"] for t in trajs if t["status"] == "trained")
