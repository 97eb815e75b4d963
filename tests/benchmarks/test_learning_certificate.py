"""The learning report's certificate (``benchmarks/learning_report.py``: ``certify``), on hand-built run records where
the rule it replaced (``within_one_std``, kept below as ``old_rule``) gives another answer: a hole at a smaller
staleness, one weak seed, runs that never filled their bound, too few seeds; and the paired-t bound it rests on."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from learning_report import certify, last_quarter_accuracy, paired_lower_bound, student_t_quantile, verdict  # noqa: E402

SYNC = [0.80, 0.72, 0.76, 0.84, 0.78]


def run(corr: str, eta: int, seed: int, final: float, quarter: float | None = None, counted: bool = True) -> dict:
    """A run record as ``summarise_run`` writes it, reduced to what the rules read: validations at steps 0-64, the
    last quarter (steps 48 and 64) averaging to ``quarter`` (default: ``final``)."""
    quarter = final if quarter is None else quarter
    accs = [0.0, 0.3, 0.5, 2 * quarter - final, final]
    vals = [{"step": 16 * i, "val/accuracy": a} for i, a in enumerate(accs)]
    return {"correction": corr, "staleness": eta, "seed": seed, "vals": vals, "counted": counted}


def arm(corr: str, eta: int, finals: list[float], **kw) -> list[dict]:
    return [run(corr, eta, seed, f, **kw) for seed, f in enumerate(finals, start=1)]


def old_rule(runs: list[dict], correction: str) -> int | None:
    """``within_one_std`` as it was before issue #34: the largest staleness whose *counted* runs' mean final accuracy
    is within sync's population std of sync's mean, two-sided, on any number of counted seeds."""
    final = [r for r in runs if r["counted"]]
    sync = [r["vals"][-1]["val/accuracy"] for r in final if r["correction"] == "default" and r["staleness"] == 0]
    best = None
    for eta in sorted({r["staleness"] for r in runs if r["correction"] == correction}):
        xs = [r["vals"][-1]["val/accuracy"] for r in final if r["correction"] == correction and r["staleness"] == eta]
        if xs and abs(statistics.fmean(xs) - statistics.fmean(sync)) <= statistics.pstdev(sync) + 1e-12:
            best = max(best or 0, eta)
    return best


def shifted(base: list[float], by: float, jitter: float = 0.01) -> list[float]:
    """``base`` moved by ``by``, each seed off by +-``jitter`` so the paired differences have a spread."""
    return [x + by + (jitter if i % 2 else -jitter) for i, x in enumerate(base)]


def test_a_hole_at_a_smaller_staleness_ends_the_certificate():
    """Staleness 1 fails, 2 passes: the old rule certified 2 (the largest that passed); the new one 0."""
    runs = arm("default", 0, SYNC) + arm("default", 1, shifted(SYNC, -0.3)) + arm("default", 2, shifted(SYNC, 0.0))
    cert = certify(runs, "default", delta=0.05, alpha=0.05)
    assert [r["passes"] for r in cert["rows"]] == [False, True]
    assert (old_rule(runs, "default"), cert["certified"]) == (2, 0)
    assert verdict(cert).startswith("no staleness above 0 is certified")


def test_one_weak_seed_does_not_widen_the_margin():
    """Sync's seed 5 is weak (its population std 0.25); staleness 4 is 0.2 below sync on every seed: within one std,
    so the old rule certified it, but the paired lower bound is -0.2, below -delta."""
    sync = [0.80, 0.82, 0.78, 0.80, 0.20]
    runs = arm("default", 0, sync) + arm("default", 4, shifted(sync, -0.2))
    cert = certify(runs, "default", delta=0.05, alpha=0.05)
    assert statistics.pstdev(sync) > 0.2
    assert (old_rule(runs, "default"), cert["certified"]) == (4, 0)
    assert cert["rows"][0]["final"]["lower"] < -0.2


def test_beating_sync_by_more_than_its_spread_passes():
    """The old rule was two-sided (``abs``): a staleness 0.3 above sync on every seed failed it. One-sided, it passes."""
    runs = arm("default", 0, [0.5, 0.52, 0.48, 0.5, 0.5]) + arm("default", 2, shifted([0.5] * 5, 0.3))
    assert (old_rule(runs, "default"), certify(runs, "default", 0.05, 0.05)["certified"]) == (0, 2)


def test_runs_that_never_filled_their_bound_count():
    """At 16, four of five runs never reached their bound and collapsed: the old rule left them out and certified
    16 on the one counted seed; every run counts now, and 16 fails."""
    finals = [0.0, 0.0, 0.0, 0.0, SYNC[4]]
    runs = arm("default", 0, SYNC) + [
        run("default", 16, seed, f, counted=seed == 5) for seed, f in enumerate(finals, start=1)
    ]
    cert = certify(runs, "default", 0.05, 0.05)
    assert (old_rule(runs, "default"), cert["certified"]) == (16, 0)
    assert cert["rows"][0]["below_bound"] == 4 and len(cert["rows"][0]["seeds"]) == 5


@pytest.mark.parametrize("seeds", [4, 5])
def test_fewer_than_five_seeds_gives_no_certificate(seeds):
    """Sync and staleness 2 equal on every seed: with 4 seeds there is no certificate (said so), with 5 there is."""
    runs = arm("default", 0, SYNC[:seeds]) + arm("default", 2, shifted(SYNC[:seeds], 0.0))
    cert = certify(runs, "default", 0.05, 0.05)
    assert old_rule(runs, "default") == 2
    if seeds == 4:
        assert cert["certified"] is None and verdict(cert) == "no certificate: sync has 4 seeds, fewer than 5"
    else:
        assert cert["certified"] == 2


def test_an_arm_short_of_seeds_fails_even_when_its_seeds_match():
    """Sync has 5 seeds, staleness 1 only 4 (one run missing): it cannot pass, so nothing above it is certified."""
    runs = arm("default", 0, SYNC) + arm("default", 1, SYNC[:4]) + arm("default", 2, SYNC)
    cert = certify(runs, "default", 0.05, 0.05)
    assert [r["passes"] for r in cert["rows"]] == [False, True] and cert["certified"] == 0
    assert verdict(cert).endswith("staleness 1 fails: 4 seeds paired with sync, fewer than 5")


def test_both_metrics_must_pass():
    """Final accuracy equal to sync's, but the last quarter 0.3 below on every seed: fails."""
    runs = arm("default", 0, SYNC) + [run("default", 2, s, f, quarter=f - 0.3) for s, f in enumerate(SYNC, 1)]
    row = certify(runs, "default", 0.05, 0.05)["rows"][0]
    assert row["final"]["lower"] > -0.05 and row["last_quarter"]["lower"] < -0.05 and not row["passes"]


def test_the_margin_is_the_callers():
    """The same runs, 0.1 below sync on every seed: fail at delta 0.05, pass at delta 0.2."""
    runs = arm("default", 0, SYNC) + arm("default", 2, shifted(SYNC, -0.1))
    assert [certify(runs, "default", d, 0.05)["certified"] for d in (0.05, 0.2)] == [0, 2]


def test_a_correction_is_certified_on_its_own_bounds_against_sync():
    """``m2po`` at 4 and 8, paired with the default corrections' staleness 0: 4 passes, 8 fails."""
    runs = arm("default", 0, SYNC) + arm("m2po", 4, shifted(SYNC, 0.0)) + arm("m2po", 8, shifted(SYNC, -0.3))
    cert = certify(runs, "m2po", 0.05, 0.05)
    assert [r["staleness"] for r in cert["rows"]] == [4, 8] and cert["certified"] == 4


def test_last_quarter_is_the_validations_from_three_quarters_of_the_run_on():
    r = run("default", 0, 1, 0.8, quarter=0.6)
    assert last_quarter_accuracy(r) == pytest.approx(0.6) and [v["step"] for v in r["vals"]][-2:] == [48, 64]


@pytest.mark.parametrize(
    "p,df,table", [(0.95, 4, 2.1318), (0.95, 9, 1.8331), (0.90, 4, 1.5332), (0.975, 1, 12.7062), (0.99, 2, 6.9646)]
)
def test_student_t_quantile_matches_the_tables(p, df, table):
    assert student_t_quantile(p, df) == pytest.approx(table, abs=1e-4)


def test_paired_lower_bound_is_mean_minus_t_times_standard_error():
    diffs = [-0.1, 0.0, 0.05, -0.05, 0.1]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    assert paired_lower_bound(diffs, 0.05) == pytest.approx(statistics.fmean(diffs) - 2.1318 * se, abs=1e-4)
    assert paired_lower_bound([0.1], 0.05) is None
