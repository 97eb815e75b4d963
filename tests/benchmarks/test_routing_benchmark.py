"""benchmarks/routing.py smoke-tested as a subprocess on a tiny budget: it runs and ends with one JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_routing_benchmark_runs_and_ends_with_one_json_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "routing.py"), "--steps", "3", "--seeds", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["ratio_to_round_robin"]["round_robin"] == 1.0 and len(last["ratio_to_round_robin"]) == 6
