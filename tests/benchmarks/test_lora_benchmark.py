"""benchmarks/lora.py smoke-tested as a subprocess at 1 layer: it runs, ends with one JSON line holding both ratios at
1 and 2 ranks, full fine-tuning publishes the whole state every version while LoRA's step version is a small part
of it, and LoRA's AdamW state is a small part of full fine-tuning's."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_lora_benchmark_runs_and_ends_with_one_json_line():
    last = run_benchmark("lora.py", "--layers", "1", env={"OMP_NUM_THREADS": "1"})
    assert [(r["mode"], r["world"]) for r in last["runs"]] == [("full", 1), ("lora", 1), ("full", 2), ("lora", 2)]
    full = [r for r in last["runs"] if r["mode"] == "full"]
    assert all(r["version_bytes"] == r["first_version_bytes"] >= r["model_bytes"] for r in full)
    assert set(last["ratios"]) == {"1", "2"}
    assert 0 < last["bytes_ratio_max"] <= 0.03 and 0 < last["optim_ratio_max"] <= 0.05
