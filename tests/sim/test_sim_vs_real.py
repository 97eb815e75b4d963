"""The simulator against a real ``psrl train`` run (slow: it trains a tiny model for real)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_replay_predicts_seconds_per_step_within_15_percent(tmp_path):
    """Replaying a real run's trajectories.jsonl / metrics.jsonl predicts its seconds per step within 15%,
    with the psrl model and with the real coordinator in virtual time."""
    run = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "psrl.cli", "train", "trainer.total_steps=12", f"trainer.run_dir={run}"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert train.returncode == 0, train.stderr[-2000:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sim_vs_real
    finally:
        sys.path.pop(0)
    for policy in ("psrl", "coordinator"):
        row = sim_vs_real.compare_run(run, policy)
        assert abs(row["error"]) <= 0.15, (policy, row)
