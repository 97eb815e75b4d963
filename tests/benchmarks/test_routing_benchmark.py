"""benchmarks/routing.py smoke-tested as a subprocess on a tiny budget: it runs and ends with one JSON line."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_routing_benchmark_runs_and_ends_with_one_json_line():
    last = run_benchmark("routing.py", "--steps", "3", "--seeds", "0")
    assert last["ratio_to_round_robin"]["round_robin"] == 1.0 and len(last["ratio_to_round_robin"]) == 6
