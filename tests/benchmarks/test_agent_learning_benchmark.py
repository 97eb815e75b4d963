"""``benchmarks/agent_learning.py`` runs end to end (the built-in model, a tiny budget): the example agent, warm
started from its demonstration, trains over two seeds within the bound and reports the curves it stores; seeds a
second invocation finds stored with the same settings are kept, not run again."""

import json
import sys

import pytest

from tests.benchmarks.run import ROOT, run_benchmark

sys.path.insert(0, str(ROOT / "benchmarks"))
from agent_learning import seeds_argv, stored_runs  # noqa: E402

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


def test_the_stored_command_names_every_seed_the_file_holds():
    argv = ["benchmarks/agent_learning.py", "--seeds", "2", "--steps", "4", "a.b=1"]
    assert seeds_argv(argv, [0, 1, 2]) == [
        "benchmarks/agent_learning.py",
        "--seeds",
        "0",
        "1",
        "2",
        "--steps",
        "4",
        "a.b=1",
    ]
    assert seeds_argv(["b.py", "--steps", "4"], [0, 2]) == ["b.py", "--seeds", "0", "2", "--steps", "4"]


def test_only_runs_of_the_same_settings_are_kept(tmp_path):
    path = tmp_path / "r.json"
    settings = {"model": "builtin", "overrides": ["a=1"], "steps": 4, "warm_start": {"steps": 2}}
    assert stored_runs(path, settings) == {}
    path.write_text(json.dumps(settings | {"command": "x", "runs": [{"seed": 3, "steps": 4}]}))
    assert stored_runs(path, settings) == {3: {"seed": 3, "steps": 4}}
    assert stored_runs(path, settings | {"overrides": ["a=2"]}) == {}
    assert stored_runs(path, settings | {"warm_start": {"steps": 3}}) == {}


@pytest.mark.slow
def test_the_benchmark_stores_each_seeds_curves_and_audit(tmp_path):
    results = tmp_path / "agent_learning.json"
    args = ["--model", "builtin", "--steps", "2", "--out", str(tmp_path / "runs"), "--results", str(results)]
    run_benchmark("agent_learning.py", "--seeds", "1", *args, *TINY)
    seed1 = tmp_path / "runs" / "seed1" / "trajectories.jsonl"
    first = seed1.stat().st_mtime_ns
    out = run_benchmark("agent_learning.py", "--seeds", "1", "2", *args, *TINY)
    stored = json.loads(results.read_text())
    assert out["seeds"] == 2 and out["violations"] == 0
    assert seed1.stat().st_mtime_ns == first  # seed 1 was kept from the first invocation, not run again
    assert stored["warm_start"]["steps"] == 2 and len(stored["warm_start"]["losses"]) == 2
    assert stored["command"].startswith("PYTHONPATH=src python ") and "--seeds 1 2 " in stored["command"]
    assert [r["seed"] for r in stored["runs"]] == [1, 2]
    for run in stored["runs"]:
        assert len(run["curves"]["reward/mean"]) == len(run["curves"]["batch/tool_call_frac"]) == 2
        assert run["audit"]["trained"] == 2 * 2 and run["audit"]["violations"] == 0
    assert (tmp_path / "runs" / "warm.pt").exists()
