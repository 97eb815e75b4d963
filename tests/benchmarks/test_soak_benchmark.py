"""benchmarks/soak.py smoke-tested as a subprocess on a tiny budget (tiny model, half a minute, high fault
rates): it injects every fault kind, kills and resumes the run, and its audit is clean."""

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_soak_runs_kills_resumes_and_audits_clean(tmp_path):
    last = run_benchmark(
        "soak.py",
        "--minutes",
        "0.6",
        "--run-dir",
        str(tmp_path),
        "--p-engine",
        "0.01",
        "--p-reward",
        "0.05",
        "trainer.warm_start_steps=5",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "trainer.checkpoint_every=2",
        timeout=900,
    )
    assert last["kills"] == 1 and last["lost"] == 0 and last["violations"] == 0 and last["trained"] > 0
    assert last["unexplained_failures"] == 0 and not any(last["duplicates"].values())
    assert {"engine_kill", "reward_hang", "reward_raise", "reward_nan"} <= set(last["injected"])
