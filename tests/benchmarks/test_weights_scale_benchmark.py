"""benchmarks/weights_scale.py smoke-tested as a subprocess at 1 layer, the small size, 1 and 2 ranks: it runs, ends
with one JSON line holding the headline keys, each configuration publishes the model's tensors once per version
(a tied tensor once: the fp32 version's bytes are the parameters' bytes), and a rank's publish peak stays within
one bucket + 10 % of its shard through either transport."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_weights_scale_benchmark_runs_and_ends_with_one_json_line():
    last = run_benchmark("weights_scale.py", "--sizes", "small", "--layers", "1", env={"OMP_NUM_THREADS": "1"})
    assert {"driver_weight_ratio_vllm", "rank_publish_excess_ratio", "sync_over_copy"} <= set(last)
    assert [(r["world"], r["transport"]) for r in last["runs"]] == [
        (1, "memory"),
        (1, "files"),
        (1, "collective"),
        (2, "files"),
        (2, "collective"),
    ]
    assert all(r["weights_bytes"] == r["model_bytes"] and r["sync_s"] > 0 for r in last["runs"])
    assert all(r["rank_publish_excess"] <= 1.0 for r in last["runs"] if r["world"] == 2)
    assert last["headline"].startswith("small at 2 ranks")
