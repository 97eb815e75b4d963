"""benchmarks/trainer_scale.py smoke-tested as a subprocess at 1 layer and a tiny batch: it runs, ends with one JSON
line, each of 2 ranks holds half the state, and both world sizes give the same loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trainer_scale_benchmark_runs_and_ends_with_one_json_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = ["--layers", "1", "--seqs", "2", "--prompt", "4", "--response", "4"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer_scale.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["state_bytes_ratio"] <= 0.55 and last["publish_s"] > 0 and last["step_time_ratio"] > 0
    assert last["loss_2ranks"] == pytest.approx(last["loss_1rank"], rel=1e-4, abs=1e-6)
