"""benchmarks/heap_cost.py smoke-tested as a subprocess: one synchronous step of the built-in job under each heap
setting, paired run by run; it ends with one JSON line holding each setting's figures and the ratios to ``none``."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_heap_cost_benchmark_runs_each_setting_and_ends_with_one_json_line():
    last = run_benchmark(
        "heap_cost.py", "--jobs", "default", "--runs", "1", "--steps", "1", env={"OMP_NUM_THREADS": "1"}
    )
    for setting in ("none", "threshold", "psrl"):
        assert last[f"default_wall_s_{setting}"] > 0 and last[f"default_peak_rss_bytes_{setting}"] > 0
    assert last["default_wall_psrl_over_none"] > 0 and last["default_wall_threshold_over_none"] > 0
