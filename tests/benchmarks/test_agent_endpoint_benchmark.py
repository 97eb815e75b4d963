"""``benchmarks/agent_endpoint.py`` runs end to end (the built-in model, a tiny budget) and reports its ratio."""

import pytest

from tests.benchmarks.run import run_benchmark


def test_the_benchmark_measures_both_paths_and_ends_with_the_ratio():
    out = run_benchmark(
        "agent_endpoint.py", "--model", "builtin", "--agents", "2", "--turns", "2", "--tokens", "4", "--repeats", "1"
    )
    assert out["direct_tokens_per_s"] > 0 and out["endpoint_tokens_per_s"] > 0
    ratio = out["endpoint_tokens_per_s"] / out["direct_tokens_per_s"]
    assert out["endpoint_over_direct"] == pytest.approx(ratio, rel=1e-2)
    assert out["engine"] == "hf" and out["hf_endpoint_over_direct"] == out["endpoint_over_direct"]
