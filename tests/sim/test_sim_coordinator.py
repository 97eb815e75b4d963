"""The ``coordinator`` policy runs psrl train's real Coordinator in virtual time; the ``psrl``
policy is the simulator's fast model of it. On the same workload (same stream of generation
times) the two must tell the same story: same trajectories launched and trained, same
throughput, idle fractions, staleness, waste and length bias.
"""

import pytest

from psrl.sim import Workload, simulate

BASE = Workload(
    slots=16,
    steps=30,
    staleness=1,
    batch_size=4,
    redundant_batch_size=4,
    group_size=4,
    redundant_group_size=4,
    sigma=1.0,
    train_time=1.5,
    seed=3,
)

CASES = {
    "plain": {},
    "eta0": {"staleness": 0},
    "eta3": {"staleness": 3},
    "batch_redundancy": {"redundant_batch_size": 6},
    "group_redundancy": {"redundant_group_size": 6},
    "both_redundancy": {"redundant_batch_size": 6, "redundant_group_size": 5},
    "filter": {"filter_drop_rate": 0.3},
    "sync_delay": {"sync_time": 0.3},
    "retry": {"proactive_method": "retry", "proactive_threshold": 1},
    "truncate": {"proactive_method": "truncate", "proactive_threshold": 2},
    "head": {"proactive_method": "truncate", "proactive_threshold": 2, "proactive_scope": "head"},
    "head_grace": {
        "proactive_method": "truncate",
        "proactive_threshold": 2,
        "proactive_scope": "head",
        "proactive_grace": 0.5,
    },
    "head_retry": {"proactive_method": "retry", "proactive_threshold": 1, "proactive_scope": "head"},
    "pareto": {"dist": "pareto", "alpha": 1.5},
    "per_token_train": {"train_time": 0.5, "train_time_per_token": 0.01},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_and_real_coordinator_agree(case):
    wl = BASE.replace(**CASES[case])
    model, real = simulate(wl, "psrl"), simulate(wl, "coordinator")
    assert real.policy == "coordinator"
    assert (real.launched_trajectories, real.trained_trajectories) == (
        model.launched_trajectories,
        model.trained_trajectories,
    )
    assert (real.staleness_max, real.staleness_p99, real.violations) == (model.staleness_max, model.staleness_p99, 0)
    for key in (
        "ratio_to_ideal",
        "trainer_idle",
        "generator_idle",
        "discarded_fraction",
        "wasted_fraction",
        "length_bias",
        "staleness_mean",
    ):
        assert getattr(real, key) == pytest.approx(getattr(model, key), abs=0.01), key


def test_real_coordinator_keeps_the_bound_where_it_waits_for_stragglers():
    """Heavy tail, no redundancy: the real code trains every trajectory (no discard, no bias) within eta."""
    r = simulate(BASE.replace(sigma=1.5, steps=40, staleness=2), "coordinator")
    assert r.violations == 0 and r.staleness_max <= 2
    assert r.discarded_fraction == 0 and r.wasted_fraction == 0
    assert r.length_bias == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("grace", [0.0, 0.5, 2.5])
def test_head_scope_grace_counts_from_the_same_moment_in_model_and_real(grace):
    """The trace of test_sim_peers' head-scope test (the trainer waits for buffer 0 from the start, a 10 s
    straggler holds it): the real coordinator's grace starts when its trainer begins to wait, as the model's
    does, so both cut at the same moment and train the same cut."""
    wl = Workload(
        slots=4,
        steps=3,
        staleness=1,
        batch_size=2,
        redundant_batch_size=2,
        group_size=1,
        redundant_group_size=1,
        dist="trace",
        trace=(1.0, 1.0, 1.0, 10.0) + (1.0,) * 20,
        train_time=3.0,
        proactive_method="truncate",
        proactive_threshold=1,
        proactive_scope="head",
        proactive_grace=grace,
    )
    model, real = simulate(wl, "psrl"), simulate(wl, "coordinator")
    assert real.length_bias < 1.0  # the straggler was cut
    for key in ("ratio_to_ideal", "trainer_idle", "length_bias", "wasted_fraction"):
        assert getattr(real, key) == pytest.approx(getattr(model, key), abs=1e-9), key
