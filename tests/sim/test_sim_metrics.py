"""Metrics: the fast histogram statistics against numpy, and the frontier against a brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.sim.metrics import Recorder, Result, percentile_from_hist, warmup_steps
from psrl.sim.report import best_at, format_frontier, format_table, frontier


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=300), st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_percentile_from_hist_matches_numpy(values, q):
    """p-th percentile from the staleness histogram == numpy's inverted-CDF percentile of the raw values."""
    hist = np.bincount(values).tolist()
    assert percentile_from_hist(hist, q) == int(np.percentile(values, q * 100, method="inverted_cdf"))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0.1, 5.0)), min_size=1, max_size=100))
def test_recorder_staleness_and_bias_match_direct_computation(items):
    """Recorder's mean / max / violations / length_bias equal a direct computation over the trained list."""
    rec = Recorder(slots=4, eta=2)
    for s, d in items:
        rec.trained(s, d, d)
    rec.cancelled(10.0, 1.0)
    rec.step_done(1.0, 0.5, 2.0)
    r = rec.result("x", ideal=100.0, launched=len(items) + 1)
    stal = [s for s, _ in items]
    assert r.staleness_mean == pytest.approx(np.mean(stal))
    assert r.staleness_max == max(stal)
    assert r.violations == sum(s > 2 for s in stal)
    trained_mean = np.mean([d for _, d in items])
    all_mean = (sum(d for _, d in items) + 10.0) / (len(items) + 1)
    assert r.length_bias == pytest.approx(trained_mean / all_mean)
    assert r.wasted_fraction == pytest.approx(1.0 / (sum(d for _, d in items) + 1.0))


@pytest.mark.parametrize("steps,w", [(1, 1), (9, 1), (10, 1), (25, 2), (250, 25)])
def test_warmup_is_ten_percent_at_least_one(steps, w):
    """The pipeline fill left out of rates: the first 10% of the steps, at least one."""
    assert warmup_steps(steps) == w


def _res(policy, smax, sph, eta=0):
    return Result(policy, eta, sph, 100.0, sph / 100, 0, 0, 0, smax, smax, 0, 0, 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.floats(1, 100)), min_size=1, max_size=12), st.integers(0, 9))
def test_frontier_is_best_throughput_at_or_below_each_staleness(points, s):
    """frontier(): the best steps/h at true staleness <= s equals the brute-force max over the points."""
    fr = frontier([_res("p", smax, sph) for smax, sph in points])["p"]
    brute = max((sph for smax, sph in points if smax <= s), default=None)
    best = None
    for p in fr:
        if p.s <= s:
            best = p.steps_per_hour
    assert best == brute
    assert [p.s for p in fr] == sorted({p.s for p in fr})  # ascending, one point per level
    pt = best_at(fr, s)
    assert (pt and pt.steps_per_hour) == (brute and best)  # best_at agrees, and carries its run
    assert pt is None or pt.result.staleness_max <= s


def test_frontier_under_a_length_bias_constraint_drops_biased_runs():
    """min_length_bias removes runs below it for every policy; the cells show each point's
    discarded fraction and length bias."""
    fast_biased = _res("p", 1, 90.0)
    fast_biased.length_bias, fast_biased.discarded_fraction = 0.80, 0.25
    fair = _res("p", 1, 60.0)
    assert frontier([fast_biased, fair])["p"][0].steps_per_hour == 90.0
    assert frontier([fast_biased, fair], min_length_bias=0.95)["p"][0].steps_per_hour == 60.0
    text = format_frontier([fast_biased, fair])
    assert "90.0  0.25  0.80" in text
    assert "60.0  0.00  1.00" in format_frontier([fast_biased, fair], min_length_bias=0.95)
    assert frontier([fast_biased], min_length_bias=0.95) == {"p": []}


def test_tables_render_every_row():
    """The table has a header and one line per result; the frontier has one line per staleness level."""
    rs = [_res("psrl", 2, 50.0, 2), _res("areal", 5, 60.0, 2)]
    assert len(format_table(rs).splitlines()) == 3
    assert "psrl" in format_frontier(rs) and len(format_frontier(rs).splitlines()) == 3 + 2
