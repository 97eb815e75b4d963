"""``psrl simulate``'s entry point: JSON keys, sweeps, plot, errors; and a subprocess smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psrl.sim import DEFAULT_POLICIES, JSON_KEYS
from psrl.sim.cli import main

SMALL = ["sim.steps=6", "sim.slots=8", "psrl.staleness_buffer_entries=2", "psrl.rollout_n=2"]


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_json_prints_one_object_per_policy_with_exactly_the_keys(capsys):
    """--json: one object per policy, keys exactly JSON_KEYS, in the policies' order."""
    assert main(SMALL + ["--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == list(DEFAULT_POLICIES)
    for r in rows:
        assert tuple(r) == JSON_KEYS
        assert r["violations"] >= 0 and 0 <= r["trainer_idle"] <= 1


def test_sweep_runs_each_value_and_prints_the_frontier(capsys):
    """--sweep psrl.staleness=0,1,3 runs every chosen policy at each eta; the table shows the frontier."""
    assert main(SMALL + ["--policies", "psrl,areal", "--sweep", "psrl.staleness=0,1,3"]) == 0
    out = capsys.readouterr().out
    assert "frontier" in out
    assert main(SMALL + ["--policies", "psrl,areal", "--sweep", "psrl.staleness=0,1,3", "--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [(r["policy"], r["staleness"]) for r in rows] == [(p, e) for e in (0, 1, 3) for p in ("psrl", "areal")]


def test_frontier_flag_prints_only_the_frontier(capsys):
    """--frontier: no table, the frontier (eta swept over 0,1,2,4,8 without --sweep), with discard and bias."""
    assert main(SMALL + ["--policies", "psrl,discard_requeue", "--frontier"]) == 0
    out = capsys.readouterr().out
    assert "frontier" in out and "disc" in out and "bias" in out
    assert "violations" not in out  # the table's header is not printed
    assert main(SMALL + ["--policies", "psrl,discard_requeue", "--frontier", "--json"]) == 0
    pts = _json_lines(capsys.readouterr().out)
    assert {p["policy"] for p in pts} == {"psrl", "discard_requeue"}
    for p in pts:
        assert set(p) == {
            "policy",
            "s",
            "steps_per_hour",
            "ratio_to_ideal",
            "discarded_fraction",
            "length_bias",
            "staleness",
        }
    psrl = [p for p in pts if p["policy"] == "psrl"]
    assert all(p["discarded_fraction"] == 0 and p["length_bias"] == 1.0 for p in psrl)
    assert [p["s"] for p in psrl] == sorted({p["s"] for p in psrl})


def test_min_length_bias_applies_to_every_policy(capsys):
    """--min-length-bias 1.01 leaves no run to any policy; 0 keeps them all."""
    assert (
        main(
            SMALL
            + ["sim.gen_time.sigma=1.0", "--policies", "psrl,areal", "--frontier", "--json", "--min-length-bias", "0"]
        )
        == 0
    )
    assert _json_lines(capsys.readouterr().out)
    assert main(SMALL + ["--policies", "psrl,areal", "--frontier", "--min-length-bias", "1.5"]) == 2
    assert "--min-length-bias" in capsys.readouterr().err


def test_config_file_and_overrides(tmp_path, capsys):
    """A YAML file is read first, overrides win."""
    cfg = tmp_path / "w.yaml"
    cfg.write_text(
        "sim:\n  steps: 4\n  slots: 4\npsrl:\n  staleness: 1\n  rollout_n: 2\n  staleness_buffer_entries: 2\n"
    )
    assert main([str(cfg), "psrl.staleness=3", "--policies", "psrl", "--json"]) == 0
    (row,) = _json_lines(capsys.readouterr().out)
    assert row["staleness"] == 3 and row["staleness_max"] <= 3


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--policies", "psrl,nope"], "--policies"),
        (["sim.slotz=3"], "sim.slotz"),
        (["--sweep", "psrl.staleness"], "--sweep"),
    ],
)
def test_errors_name_the_key_and_exit_2(argv, key, capsys):
    """Bad input exits with status 2 and a message naming what to fix."""
    assert main(SMALL + argv) == 2
    assert key in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
    """--plot FILE writes a PNG (sweeping eta when no --sweep is given)."""
    out = tmp_path / "f.png"
    assert main(SMALL + ["--policies", "psrl,sync", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    constrained = tmp_path / "g.png"  # with the length-bias panel
    assert (
        main(SMALL + ["--policies", "psrl,discard_requeue", "--plot", str(constrained), "--min-length-bias", "0.9"])
        == 0
    )
    assert constrained.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_runs_as_a_subprocess():
    """python -m psrl.sim.cli works end to end with a tiny budget."""
    proc = subprocess.run(
        [sys.executable, "-m", "psrl.sim.cli", *SMALL, "--json", "--policies", "psrl"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert _json_lines(proc.stdout)[0]["policy"] == "psrl"


def test_reference_benchmark_runs_quick():
    """benchmarks/policies.py --quick prints the table, the acceptance lines and the frontier."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "policies.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "acceptance" in out and "frontier" in out
    assert out.count("psrl B'=1.5B") >= 9
