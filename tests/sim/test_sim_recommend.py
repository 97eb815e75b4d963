"""``psrl simulate --recommend RUN_DIR --out FILE``: the written config, its prediction replayed in virtual time,
the constraints; and how :mod:`psrl.sim.replay` replays cut-short and missing generation times."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from psrl.config import config_to_dict, load_config
from psrl.sim import simulate
from psrl.sim.cli import main
from psrl.sim.recommend import KEYS, recommend
from psrl.sim.replay import EXTENSION, filter_drop_rate, replay_trace, replay_workload

STEPS = 20
SMALL = [
    "psrl.staleness=1",
    "psrl.staleness_buffer_entries=4",
    "psrl.rollout_n=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
]


def _fake_run(path: Path, overrides=(), records=None, sigma=1.0, seed=0) -> Path:
    """A run directory as psrl train writes it: its full config.yaml, trajectories.jsonl in completion order,
    metrics.jsonl with the time and time/train_s columns."""
    path.mkdir(parents=True, exist_ok=True)
    data = config_to_dict(load_config(None, SMALL + list(overrides)))
    data["trainer"]["run_dir"] = str(path)
    (path / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    rng = np.random.default_rng(seed)
    if records is None:
        records = []
        for k in range(STEPS * 4 + 8):
            for m in range(2):
                t = float(rng.lognormal(np.log(0.2), sigma))
                records.append(
                    {"uid": f"g{k}-{m}", "group": f"g{k}", "v_traj": 0, "status": "trained", "gen_seconds": t}
                )
        records.sort(key=lambda r: r["gen_seconds"])  # written as they resolve, not in launch order
    (path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [{"step": i, "time": 0.3 * i, "time/train_s": 0.1} for i in range(1, STEPS + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="module")
def recommended(tmp_path_factory):
    """One recommendation (--max-staleness 1) on a heavy-tailed fake run: (run dir, out file, JSON line)."""
    tmp = tmp_path_factory.mktemp("rec")
    run = _fake_run(tmp / "run")
    out = tmp / "next.yaml"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--recommend", str(run), "--out", str(out), "--max-staleness", "1", "--json"]) == 0
    line = json.loads(buf.getvalue().strip().splitlines()[-1])
    return run, out, line


def test_written_file_loads_and_differs_only_in_the_recommended_keys(recommended):
    """FILE passes load_config as is; against the run's config.yaml it changes exactly the pick's keys (all of
    them recommended keys) and resets trainer.run_dir, so psrl train FILE starts a new run."""
    run, out, line = recommended
    before = _flat(config_to_dict(load_config(run / "config.yaml")))
    after = _flat(config_to_dict(load_config(out)))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == set(line["changes"]) | {"trainer.run_dir"}
    assert set(line["changes"]) <= set(KEYS)
    assert after["trainer.run_dir"] is None
    for k, v in line["changes"].items():
        assert after[k] == v


def test_the_recommended_file_replayed_in_virtual_time_runs_at_the_predicted_seconds_per_step(recommended):
    """The written file, replayed on the same run's workload (same seed), runs at the printed prediction: exactly
    with the psrl model, and psrl train's real coordinator in virtual time agrees within 1 %."""
    run, out, line = recommended
    wl = replay_workload(run, STEPS, config=out)
    assert simulate(wl, "psrl").seconds_per_step == pytest.approx(line["predicted_s_per_step"], rel=1e-9)
    assert simulate(wl, "coordinator").seconds_per_step == pytest.approx(line["predicted_s_per_step"], rel=0.01)
    assert line["staleness"] <= 1 and load_config(out).psrl.staleness == line["staleness"]
    # the run as it was is one of the configurations tried, so the pick is at least as fast (ties within 1 %)
    assert line["speedup"] >= 0.99
    assert line["length_bias"] >= 0.95 and line["discarded_fraction"] <= 0.10


def test_text_output_shows_the_frontier_and_the_pick(recommended, tmp_path, capsys):
    run, _, line = recommended
    assert main(["--recommend", str(run), "--out", str(tmp_path / "n.yaml"), "--max-staleness", "1"]) == 0
    text = capsys.readouterr().out
    assert "frontier" in text and "<- recommended" in text
    assert f"{line['predicted_s_per_step']:.3f} s/step predicted, {line['speedup']:.2f}x the run as it was" in text


def test_max_staleness_0_recommends_staleness_0(tmp_path):
    """--max-staleness 0: every configuration tried, and so the pick, is synchronous."""
    run = _fake_run(tmp_path / "run")
    rec = recommend(run, max_staleness=0)
    assert {p.staleness for p in rec.points} == {0}
    assert rec.pick.staleness == 0 and rec.pick.changes["psrl.staleness"] == 0


def test_infeasible_constraints_are_a_clear_error_and_write_nothing(tmp_path, capsys):
    """A run whose filter drops groups discards work in every configuration: --max-discard 0 cannot be met."""
    run = _fake_run(tmp_path / "run", overrides=["sim.filter_drop_rate=0.3"])
    out = tmp_path / "next.yaml"
    assert main(["--recommend", str(run), "--out", str(out), "--max-discard", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-discard" in err and "no configuration" in err and "fix:" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [["--out", "x.yaml"], ["--max-staleness", "1"], ["--recommend", "somewhere"]],
)
def test_recommend_options_out_of_place_are_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--recommend" in err or "--out" in err


def test_proactively_truncated_times_are_redrawn_from_longer_complete_ones(tmp_path):
    """In a run with method truncate a truncated record ran at least its time: it is replaced by a complete time
    >= it; without the proactive truncate (a length limit) it is kept as is. The extension follows."""
    recs = [
        {"uid": f"g{k}-{m}", "group": f"g{k}", "status": "trained", "gen_seconds": float(1 + k)}
        for k in range(10)
        for m in range(2)
    ]
    recs[0].update(truncated=True, gen_seconds=1.5)  # g0-0 cut at 1.5 s
    cfg_trunc = ["psrl.proactive_filter_strategy.method=truncate"]
    run = _fake_run(tmp_path / "t", overrides=cfg_trunc, records=recs)
    trace = replay_trace(run, load_config(run / "config.yaml"), seed=0)
    assert len(trace) == 20 * (1 + EXTENSION)
    assert trace[0] in {float(1 + k) for k in range(1, 10)}
    assert trace[1:20] == tuple(float(1 + k // 2) for k in range(1, 20))
    plain = _fake_run(tmp_path / "p", records=recs)
    kept = replay_trace(plain, load_config(plain / "config.yaml"), seed=0)
    assert kept[:20] == (1.5,) + tuple(float(1 + k // 2) for k in range(1, 20))


def test_members_a_redundant_run_cancelled_are_replayed_at_least_as_long_as_their_group(tmp_path):
    """N' = 3, N = 2: the third member was cancelled and never recorded; it is replayed in its launch slot with
    a complete time >= its group's slowest recorded member."""
    red = [
        "psrl.redundant_rollout.enable=true",
        "psrl.redundant_rollout.alg_rollout_n=2",
        "psrl.redundant_rollout.redundant_rollout_n=3",
    ]
    recs = [
        {"uid": f"g{k}-{m}", "group": f"g{k}", "status": "trained", "gen_seconds": float(k + m)}
        for k in range(8)
        for m in range(2)
    ]
    run = _fake_run(tmp_path / "r", overrides=red, records=recs)
    trace = replay_trace(run, load_config(run / "config.yaml"), seed=3)
    assert len(trace) == 24 * (1 + EXTENSION)
    for k in range(8):
        assert trace[3 * k : 3 * k + 2] == (float(k), float(k + 1))
        assert trace[3 * k + 2] >= k + 1


def test_a_filtering_run_replays_its_measured_drop_rate(tmp_path):
    recs = [
        {"uid": f"g{k}-{m}", "group": f"g{k}", "status": "filtered" if k % 4 == 0 else "trained", "gen_seconds": 1.0}
        for k in range(8)
        for m in range(2)
    ]
    run = _fake_run(tmp_path / "f", records=recs)
    assert filter_drop_rate(run) == 0.25
