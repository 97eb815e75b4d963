"""``benchmarks/agent_learning.py`` runs end to end (the built-in model, a tiny budget): the example agent, warm
started from its demonstration, trains over two seeds within the bound and reports the curves it stores."""

import json

import pytest

from tests.benchmarks.run import run_benchmark

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.n_positions=1500",
    "data.max_prompt_length=1400",
    "trainer.warm_start_steps=2",
    "psrl.rollout_n=2",
    "psrl.staleness_buffer_entries=1",
]


@pytest.mark.slow
def test_the_benchmark_stores_each_seeds_curves_and_audit(tmp_path):
    results = tmp_path / "agent_learning.json"
    out = run_benchmark(
        "agent_learning.py",
        "--model",
        "builtin",
        "--seeds",
        "1",
        "2",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "runs"),
        "--results",
        str(results),
        *TINY,
    )
    stored = json.loads(results.read_text())
    assert out["seeds"] == 2 and out["violations"] == 0
    assert stored["warm_start"]["steps"] == 2 and stored["command"].startswith("PYTHONPATH=src python ")
    for run in stored["runs"]:
        assert len(run["curves"]["reward/mean"]) == len(run["curves"]["batch/tool_call_frac"]) == 2
        assert run["audit"]["trained"] == 2 * 2 and run["audit"]["violations"] == 0
    assert (tmp_path / "runs" / "warm.pt").exists()
