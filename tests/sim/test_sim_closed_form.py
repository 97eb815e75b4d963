"""Closed-form cases: constant generation times, where throughput and staleness follow by hand.

Notation in the comments: d = generation time of every trajectory, t = train time, s = sync time,
S = slots, B groups x N per step, K = simulated steps. Rates are measured between the end of the
first and the last step, so a steady period P gives exactly 3600 / P steps per hour.
"""

import pytest

from psrl.sim import Workload, simulate

K = 20


def wl(**kw):
    base = dict(
        slots=8,
        steps=K,
        staleness=1,
        batch_size=4,
        redundant_batch_size=4,
        group_size=2,
        redundant_group_size=2,
        dist="constant",
        median=1.0,
        train_time=0.5,
        sync_time=0.0,
    )
    base.update(kw)
    if "batch_size" in kw and "redundant_batch_size" not in kw:
        base["redundant_batch_size"] = kw["batch_size"]
    if "group_size" in kw and "redundant_group_size" not in kw:
        base["redundant_group_size"] = kw["group_size"]
    return Workload(**base)


@pytest.mark.parametrize("d,t,s", [(1.0, 0.5, 0.0), (1.0, 2.0, 0.25), (2.0, 0.5, 1.0)])
def test_sync_period_is_generation_plus_train_plus_sync(d, t, s):
    """sync: each step generates a whole batch (d, S = B*N), trains (t), syncs (s): period d + t + s."""
    r = simulate(wl(median=d, train_time=t, sync_time=s), "sync")
    period = d + t + s
    assert r.steps_per_hour == pytest.approx(3600 / period)
    assert r.trainer_idle == pytest.approx(1 - t / period)
    assert r.generator_idle == pytest.approx(1 - d / period)
    assert (r.staleness_mean, r.staleness_max, r.violations) == (0, 0, 0)


@pytest.mark.parametrize("slots,rounds", [(8, 1), (4, 2), (2, 4), (3, 4), (5, 2)])
def test_sync_with_fewer_slots_generates_in_rounds(slots, rounds):
    """sync with S < B*N = 8: a group starts only when its N = 2 members all have a slot, so
    floor(S / N) groups run at once and a batch of 4 groups takes ceil(4 / floor(S / 2)) rounds of d = 1."""
    r = simulate(wl(slots=slots, train_time=0.5), "sync")
    assert r.steps_per_hour == pytest.approx(3600 / (rounds + 0.5))


@pytest.mark.parametrize("policy", ["psrl", "coordinator", "areal", "one_step_off", "sample_budget"])
@pytest.mark.parametrize("d,t", [(1.0, 0.5), (1.0, 2.0)])
def test_one_step_overlap_period_is_max_of_generation_and_training(policy, d, t):
    """eta = 1, S = B*N, no sync delay: generation of step k+1 overlaps training of step k, so the
    period is max(d, t); every batch after the first is exactly one version stale."""
    # sample_budget at verl's k = 1, staleness_threshold = 1: int(B * 2 * 1) = 2B groups per sync, as eta = 1
    r = simulate(wl(median=d, train_time=t, verl_trigger_parameter_sync_step=1, verl_staleness_threshold=1.0), policy)
    period = max(d, t)
    assert r.steps_per_hour == pytest.approx(3600 / period)
    assert r.trainer_idle == pytest.approx(1 - t / period)
    assert r.generator_idle == pytest.approx(1 - d / period)
    # first batch staleness 0, the K - 1 others staleness 1
    assert r.staleness_mean == pytest.approx((K - 1) / K)
    assert (r.staleness_p99, r.staleness_max, r.violations) == (1, 1, 0)
    assert r.trained_trajectories == K * 4 * 2
    assert r.discarded_fraction == 0 and r.length_bias == pytest.approx(1.0)


@pytest.mark.parametrize("policy", ["psrl", "coordinator", "areal", "sync"])
def test_eta_zero_is_synchronous(policy):
    """eta = 0 leaves no room to overlap: psrl and areal both fall back to sync's d + t + s."""
    r = simulate(wl(staleness=0, median=1.0, train_time=0.5, sync_time=0.25), policy)
    assert r.steps_per_hour == pytest.approx(3600 / 1.75)
    assert r.staleness_max == 0


def test_one_step_off_violates_eta_zero():
    """one_step_off is always one step stale: at eta = 0 every batch after the first violates."""
    r = simulate(wl(staleness=0), "one_step_off")
    assert r.violations == (K - 1) * 4 * 2
    assert r.staleness_max == 1


def test_discard_requeue_eta_zero_discards_every_other_batch():
    """discard_requeue, eta = 0, t < d: the batch admitted while step c trains carries V = c but is
    consumed at c + 1, so it is dropped and regenerated. Trained batches finish at d, 3d, 5d...,
    dropped ones at 2d, 4d, ...: period 2d, and K - 1 dropped batches against K trained."""
    r = simulate(wl(staleness=0, median=1.0, train_time=0.5), "discard_requeue")
    assert r.steps_per_hour == pytest.approx(3600 / 2.0)
    assert r.discarded_fraction == pytest.approx((K - 1) / (2 * K - 1))
    assert r.violations == 0
    assert r.length_bias == pytest.approx(1.0)  # all times equal: no length bias possible


@pytest.mark.parametrize("policy", ["psrl", "coordinator"])
@pytest.mark.parametrize("eta", [1, 2, 3])
def test_psrl_trainer_bound_runs_at_train_time(eta, policy):
    """psrl with a slow trainer (t = 3d): the trainer never waits after the first batch."""
    r = simulate(wl(staleness=eta, median=1.0, train_time=3.0), policy)
    assert r.steps_per_hour == pytest.approx(3600 / 3.0)
    assert r.trainer_idle == pytest.approx(0.0, abs=1e-12)
    assert r.staleness_max <= eta and r.violations == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sample_budget_publishes_every_k_steps(k):
    """sample_budget syncs weights every trigger_parameter_sync_step = k steps: every V_traj is a multiple of k."""
    from psrl.sim import POLICIES

    p = POLICIES["sample_budget"](wl(verl_trigger_parameter_sync_step=k, staleness=2))
    p.run()
    assert set(p.t_ver) <= set(range(0, K + 1, k))
    assert max(p.t_ver) > 0


def test_bounds_formulas():
    """generation bound = S / (B*N*mean) * 3600 (with the filter's loss), trainer bound = 3600 / t."""
    w = wl(slots=6, median=2.0, train_time=5.0)
    assert w.generation_bound() == pytest.approx(6 / (4 * 2 * 2.0) * 3600)
    assert w.trainer_bound() == pytest.approx(3600 / 5.0)
    assert w.ideal_steps_per_hour() == pytest.approx(min(w.generation_bound(), w.trainer_bound()))
    w2 = w.replace(filter_drop_rate=0.5)
    assert w2.generation_bound() == pytest.approx(w.generation_bound() / 2)
    w3 = w.replace(train_time_per_token=0.01, tokens_per_second=10.0)
    # tokens per step = B*N*mean*tps = 8*2*10 = 160 -> 1.6 s more
    assert w3.trainer_bound() == pytest.approx(3600 / 6.6)


def test_train_time_per_token_uses_batch_tokens():
    """sync, constant d = 1, 8 trajectories of 1 s at 10 tokens/s = 80 tokens x 0.01 s = +0.8 s per step."""
    r = simulate(wl(train_time=0.5, train_time_per_token=0.01, tokens_per_second=10.0), "sync")
    assert r.steps_per_hour == pytest.approx(3600 / (1.0 + 0.5 + 0.8))
