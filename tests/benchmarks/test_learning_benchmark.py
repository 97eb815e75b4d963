"""benchmarks/learning.py smoke-tested as a subprocess on a tiny budget: it runs, validates, draws, ends in JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_learning_benchmark_runs_and_ends_with_one_json_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "learning.py"),
            "--steps",
            "2",
            "--seeds",
            "1",
            "2",
            "--staleness",
            "0",
            "2",
            "--val-every",
            "1",
            "--out",
            str(tmp_path),
            "trainer.val_size=4",
            "trainer.warm_start_steps=5",
            "model.n_layer=1",
            "model.n_embd=32",
            "model.n_head=2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(last["per_staleness"]) == {"0", "2"} and last["seeds"] == [1, 2]
    for s in last["per_staleness"].values():
        assert s["val_accuracy"]["n"] == 2 and s["seconds_per_step"]["mean"] > 0
    assert (tmp_path / "learning.png").exists()
