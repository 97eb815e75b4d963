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
            "--corrections",
            "default",
            "m2po",
            "--correction-staleness",
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
    assert last["seeds"] == [1, 2]
    assert set(last["per_correction"]) == {"default", "m2po"}
    assert set(last["per_correction"]["default"]) == {"0", "2"} and set(last["per_correction"]["m2po"]) == {"2"}
    sync = last["per_correction"]["default"]["0"]
    assert sync["counted"] == "2/2" and sync["val_accuracy"]["n"] == 2 and sync["seconds_per_step"]["mean"] > 0
    assert 0 < sync["ess"]["mean"] <= 1 and sync["m2"]["mean"] >= 0
    # a run counts only if it reached its staleness over >= 4 x eta steps: 2 steps cannot reach staleness 2
    assert last["per_correction"]["m2po"]["2"]["counted"] == "0/2"
    assert {(c, s) for c, _, s, _ in last["not_counted"]} == {("default", 2), ("m2po", 2)}
    assert set(last["max_staleness_within_one_std_of_sync"]) == {"default", "m2po"}
    assert (tmp_path / "learning.png").exists()
