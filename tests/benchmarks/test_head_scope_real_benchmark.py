"""benchmarks/head_scope_real.py smoke-tested on a tiny budget: psrl train runs with head scope, is replayed by
both models and audited, and the script ends with one JSON line."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_head_scope_real_benchmark_runs_replays_and_audits(tmp_path):
    last = run_benchmark(
        "head_scope_real.py",
        "--seeds",
        "1",
        "--steps",
        "4",
        "--tolerance",
        "100",  # 4 steps are not a measurement: this checks the plumbing, the benchmark checks the 10 %
        "--out",
        str(tmp_path),
        "trainer.warm_start_steps=5",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
    )
    (run,) = last["runs"]
    assert last["audit_clean"] and run["violations"] == 0 and run["max_staleness"] <= run["eta"]
    assert run["trained"] > 0 and run["measured_s_per_step"] > 0 and run["predicted_s_per_step"] > 0
    assert "psrl.proactive_filter_strategy.scope=head" in last["config"]
    assert (tmp_path / "head-seed1" / "trajectories.jsonl").is_file()
