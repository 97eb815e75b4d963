"""benchmarks/learning.py smoke-tested as a subprocess on a tiny budget: it runs, validates, draws, ends in JSON."""

import json

import pytest

from tests.benchmarks.run import run_benchmark


@pytest.mark.slow
def test_learning_benchmark_runs_and_ends_with_one_json_line(tmp_path):
    last = run_benchmark(
        "learning.py",
        "--steps",
        "2",
        "--seeds",
        "1",
        "2",
        "--staleness",
        "0",
        "2",
        "--corrections",
        "default",
        "m2po",
        "adaptive",
        "--correction-staleness",
        "2",
        "--val-every",
        "1",
        "--out",
        str(tmp_path),
        "--results",
        str(tmp_path / "results.json"),
        "trainer.val_size=4",
        "trainer.warm_start_steps=5",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
    )
    assert last["seeds"] == [1, 2]
    assert set(last["per_correction"]) == {"default", "m2po", "adaptive"}
    assert set(last["per_correction"]["default"]) == {"0", "2"} and set(last["per_correction"]["m2po"]) == {"2"}
    sync = last["per_correction"]["default"]["0"]
    assert sync["counted"] == "2/2" and sync["val_accuracy"]["n"] == 2 and sync["seconds_per_step"]["mean"] > 0
    assert 0 < sync["ess"]["mean"] <= 1 and sync["m2"]["mean"] >= 0
    adaptive = last["per_correction"]["adaptive"]["2"]  # the ceiling 2; counted whatever bound the controller set
    assert adaptive["counted"] == "2/2" and 0 <= adaptive["bound_mean"]["mean"] <= 2
    # a run counts only if it reached its staleness over >= 4 x eta steps: 2 steps cannot reach staleness 2
    assert last["per_correction"]["m2po"]["2"]["counted"] == "0/2"
    assert {(c, s) for c, _, s, _ in last["not_counted"]} == {("default", 2), ("m2po", 2)}
    # 2 seeds: no certificate (it needs 5 paired with sync), for every correction
    assert last["certified_staleness"] == {"default": None, "m2po": None, "adaptive": None}
    stored = json.loads((tmp_path / "results.json").read_text())  # --results: every run and the command
    assert stored["command"].startswith("PYTHONPATH=src python benchmarks/learning.py --steps 2")
    assert len(stored["runs"]) == 8 and stored["min_seeds"] == 5
    assert (tmp_path / "learning.png").exists()
    # every run leaves psrl train's timeline, so psrl viz draws it and an adaptive run's bound moves are in it
    runs = sorted(tmp_path.rglob("metrics.jsonl"))
    assert len(runs) == 8
    for metrics in runs:
        kinds = {json.loads(line)["kind"] for line in (metrics.parent / "events.jsonl").read_text().splitlines()}
        assert {"reserve", "consume"} <= kinds, metrics.parent.name
