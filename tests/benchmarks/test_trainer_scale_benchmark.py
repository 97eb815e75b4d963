"""benchmarks/trainer_scale.py smoke-tested as a subprocess at 1 layer and a tiny batch: it runs, ends with one JSON
line, each of 2 ranks holds half the state, and both world sizes give the same loss."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_trainer_scale_benchmark_runs_and_ends_with_one_json_line():
    args = ["--layers", "1", "--seqs", "2", "--prompt", "4", "--response", "4"]
    last = run_benchmark("trainer_scale.py", *args, env={"OMP_NUM_THREADS": "1"})
    assert last["state_bytes_ratio"] <= 0.55 and last["publish_s"] > 0 and last["step_time_ratio"] > 0
    assert last["loss_2ranks"] == pytest.approx(last["loss_1rank"], rel=1e-4, abs=1e-6)
