"""The stall watchdog (trainer.stall_timeout_s): the bound on every back-pressure wait.

Virtual time (the real coordinator on fake engines): a run whose generations never return reports the stall
after one period (console and RUN_DIR/stall-1.json: buffers, in-flight trajectories per instance, last events)
and stops with a RunError after the second; slow-but-moving runs and long training steps are not stalls.
One test runs the real ``psrl train`` with a tiny timeout on a genuinely hung tool: it checkpoints and exits
with one line."""

from __future__ import annotations

import json

import pytest

from psrl.errors import RunError
from psrl.rollout.fakes import FakeTask
from psrl.runtime.recorder import EventLog, RunRecorder, read_jsonl
from tests.rollout.harness import config, coordinator, run


def hang_after(first: int):
    """latency_fn: episodes from ``first`` on wait 1e9 s in their tool call (they never return in practice)."""
    return lambda prompt, episode_no, call: 1e9 if episode_no >= first else 1.0


def test_a_hung_run_is_reported_then_stopped(tmp_path):
    """Every episode after the first 4 hangs: nothing moves once those are in. After 100 s the report names
    the STUCK buffer, its blocking entries and the hung trajectories on each instance; after 200 s the run
    stops with a RunError saying it stalled, which names the key."""
    said = []
    rec = RunRecorder(tmp_path)
    events = EventLog(tmp_path / "events.jsonl", clock=lambda: 0.0)
    coord = coordinator(
        config(trainer__stall_timeout_s=100),
        FakeTask(latency_fn=hang_after(4)),
        sink=rec,
        log=said.append,
        on_event=events,
    )
    with pytest.raises(RunError) as e:
        run(coord, 5)
    assert "stalled" in str(e.value) and "trainer.stall_timeout_s=100" in str(e.value) and "\n" not in str(e.value)
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == coord.version < 5
    stalls = [s for s in said if s.startswith("stall:")]
    assert len(stalls) == 1 and "stall-1.json" in stalls[0] and "another 100s" in stalls[0]
    report = json.loads((tmp_path / "stall-1.json").read_text())
    assert 100 <= report["idle_s"] <= 125 and report["train_version"] == coord.version
    blocking = [eid for b in report["buffers"].values() for eid in b["blocking"]]
    assert blocking and any(b["state"] == "STUCK" or b["reserved"] for b in report["buffers"].values())
    flight = [t for inst in report["instances"] for t in inst["in_flight"]]
    assert flight and {t["entry"] for t in flight} >= set(blocking) - {None}
    assert all(t["in"] == "tool call or reward" and t["age_s"] >= 100 for t in flight)
    assert report["last_events"] and report["last_events"][-1]["kind"] in ("reserve", "consume", "occupy")
    assert len(report["instances"]) == 2


def test_slow_but_moving_generation_is_not_a_stall():
    """Each tool call takes 80 s with a 100 s timeout: trajectories keep completing, so no report and no stop."""
    said = []
    coord = coordinator(config(trainer__stall_timeout_s=100), FakeTask(tool_latency=80.0), log=said.append)
    rows = run(coord, 8)
    assert len(rows) == 8 and rows[-1]["time"] > 300 and not [s for s in said if "stall" in s]


def test_a_long_training_step_is_not_a_stall():
    """Synchronous (staleness 0): generation waits for a 1000 s training step, 10 periods; the step is progress."""
    said = []
    coord = coordinator(config(psrl__staleness=0, trainer__stall_timeout_s=100), train_time=1000.0, log=said.append)
    rows = run(coord, 3)
    assert len(rows) == 3 and not [s for s in said if "stall" in s]


def test_psrl_train_on_a_hung_tool_checkpoints_and_says_so(tmp_path, capsys):
    """Real psrl train (tiny model): every tool call hangs (1e6 s), stall_timeout_s=1. It reports the stall,
    stops with one line after the second period, and leaves a checkpoint the same command resumes from."""
    from psrl.runtime.checkpoint import load_checkpoint
    from psrl.train_cli import main
    from tests.runtime.test_train_cli_e2e import TINY

    run_dir = tmp_path / "run"
    rc = main(
        TINY
        + [
            f"trainer.run_dir={run_dir}",
            "trainer.total_steps=3",
            "trainer.stall_timeout_s=1",
            "task.tool_latency_median=1e6",
            "task.tool_latency_sigma=0",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "stalled" in err, err
    assert "stall:" in out and (run_dir / "stall-1.json").exists()
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))  # episodes that answer without a tool call still finish
    assert steps < 3 and load_checkpoint(run_dir)["version"] == steps
