"""The same arrival of work for every policy: the i-th launched trajectory gets the i-th draw."""

import json
import math

import numpy as np
import pytest

from psrl.config import ConfigError, load_config
from psrl.sim import POLICIES, Workload
from psrl.sim.trace import load_trace
from psrl.sim.workload import _CHUNK

WL = Workload(
    slots=16,
    steps=15,
    staleness=2,
    batch_size=4,
    redundant_batch_size=6,
    group_size=2,
    redundant_group_size=3,
    sigma=1.0,
    train_time=0.8,
    seed=7,
    filter_drop_rate=0.2,
)


def _run(policy, wl=WL):
    p = POLICIES[policy](wl)
    p.run()
    return p


def test_every_policy_sees_the_same_stream():
    """Policies launch different numbers of trajectories, but the k-th launch draws the same time in all."""
    runs = {name: _run(name).t_drawn for name in POLICIES}  # coordinator included
    n = min(len(v) for v in runs.values())
    assert n > 50
    ref = runs["psrl"][:n]
    for name, drawn in runs.items():
        assert drawn[:n] == ref, name


def test_filter_decisions_follow_group_order():
    """The i-th created group gets the i-th filter draw in every policy (same kept/dropped pattern)."""
    a, b = _run("psrl"), _run("areal")
    n = min(len(a.filter_draws), len(b.filter_draws))
    assert n > 10 and a.filter_draws[:n] == b.filter_draws[:n]


def test_seed_changes_the_stream_and_reruns_reproduce():
    """Same seed -> identical results; another seed -> other generation times."""
    assert _run("psrl").t_drawn == _run("psrl").t_drawn
    assert _run("psrl", WL.replace(seed=8)).t_drawn[:20] != _run("psrl").t_drawn[:20]


def test_stream_matches_one_numpy_draw_across_chunks():
    """Chunked drawing gives the same numbers as one big lognormal draw (checked across a chunk edge)."""
    s = WL.gen_stream()
    got = [s.next() for _ in range(_CHUNK + 5)]
    rng = np.random.default_rng([WL.seed, 0])
    want = np.concatenate(
        [rng.lognormal(math.log(WL.median), WL.sigma, _CHUNK), rng.lognormal(math.log(WL.median), WL.sigma, _CHUNK)[:5]]
    )
    assert np.allclose(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dist,shape", [("lognormal", {"sigma": 0.7}), ("pareto", {"alpha": 2.5})])
def test_stream_has_the_configured_median_and_mean(dist, shape):
    """Large-sample median and mean of the stream match the closed forms used by the ideal bound."""
    wl = Workload(dist=dist, median=2.0, **shape)
    s = wl.gen_stream()
    x = np.array([s.next() for _ in range(200_000)])
    assert np.median(x) == pytest.approx(2.0, rel=0.02)
    assert x.mean() == pytest.approx(wl.mean_gen_time(), rel=0.03)


def test_trace_replays_gen_seconds_in_order(tmp_path):
    """dist=trace replays a run's gen_seconds in file order, cycling; metrics.jsonl's time/train_s sets train_time."""
    trace = tmp_path / "trajectories.jsonl"
    rows = [
        {"gen_seconds": 1.5, "status": "trained"},
        {"gen_seconds": 0.5, "status": "trained"},
        {"gen_seconds": 9.0, "status": "aborted"},
        {"gen_seconds": 2.0, "status": "surplus"},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time/train_s": 0.25}\n{"step": 2, "time/train_s": 0.75}\n')
    assert load_trace(trace) == [1.5, 0.5, 2.0]
    wl = Workload.from_config(load_config(None, ["sim.gen_time.dist=trace", f"sim.gen_time.trace={trace}"]))
    assert wl.train_time == pytest.approx(0.5)
    s = wl.gen_stream()
    assert [s.next() for _ in range(7)] == [1.5, 0.5, 2.0, 1.5, 0.5, 2.0, 1.5]
    assert wl.mean_gen_time() == pytest.approx(4.0 / 3)


@pytest.mark.parametrize(
    "override,key",
    [
        (["sim.gen_time.dist=pareto", "sim.gen_time.alpha=1.0"], "sim.gen_time.alpha"),
        (["sim.filter_drop_rate=1.0"], "sim.filter_drop_rate"),
        (["sim.verl.trigger_parameter_sync_step=0"], "sim.verl.trigger_parameter_sync_step"),
        (["sim.verl.staleness_threshold=-0.5"], "sim.verl.staleness_threshold"),
        (["sim.slots=3", "psrl.rollout_n=4"], "sim.slots"),
    ],
)
def test_bad_workloads_name_the_key(override, key):
    """Workloads the simulator cannot run are refused with the config key in the message."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Workload.from_config(load_config(None, override))


def test_trace_is_replayed_in_launch_order(tmp_path):
    """psrl train writes records as they resolve; ids g<k>-<m> restore the launch order for the replay."""
    trace = tmp_path / "trajectories.jsonl"
    rows = [
        {"group": "g1", "uid": "g1-0", "gen_seconds": 0.1},
        {"group": "g0", "uid": "g0-1", "gen_seconds": 0.2},
        {"group": "g10", "uid": "g10-0", "gen_seconds": 0.3},
        {"group": "g0", "uid": "g0-0", "gen_seconds": 0.4},
        {"group": "g2", "uid": "g2-0", "gen_seconds": 0.5},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_trace(trace) == [0.4, 0.2, 0.1, 0.5, 0.3]
