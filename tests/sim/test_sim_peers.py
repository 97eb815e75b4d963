"""Each peer policy's rules, pinned on workloads small enough to work out by hand.

The expected numbers come from the arithmetic in the peer's own code (cited in
``psrl/sim/baselines.py``), not from running the simulator: constant generation time d, training
time t, sync time s, B groups of N per step, and (where it matters) a replayed trace. Rates are
measured between the end of warm-up (10% of the steps) and the last step.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.config import ConfigError, load_config
from psrl.sim import POLICIES, Workload
from psrl.sim.baselines import verl_max_required_samples

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
    return Workload(**base)


def run(policy, w):
    """Run a policy; return it with the list of (trajectory indices, version) it trained."""
    p = POLICIES[policy](w)
    trained = []
    orig = p.start_training

    def spy(batch, version):
        trained.append((list(batch), version))
        orig(batch, version)

    p.start_training = spy
    res = p.run()
    return p, res, trained


def period(res):
    return 3600.0 / res.steps_per_hour


def max_running_groups(p):
    """Most groups generating at once, from the launch and completion times of every trajectory."""
    events = []
    for idx, g in enumerate(p.t_group):
        if idx == g.members[0]:
            start = p.t_start[idx]
            events += [(start, 1), (start + p.t_drawn[idx], -1)]
    run = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        run += d
        best = max(best, run)
    return best


# ---------------------------------------------------------------------------------------- AReaL


def _areal_step_ends(eta, d, t, steps):
    """AReaL's StalenessManager.get_capacity with unbounded concurrency: batch j (groups jB..jB+B-1)
    can be submitted once (eta + v + 1) * B >= (j + 1) * B, i.e. at version v = j - eta, which the
    trainer reaches at the end of step j - eta - 1. So T_j = max(T_{j-1}, T_{j-eta-1} + d) + t."""
    T = []
    for j in range(steps):
        submit = T[j - eta - 1] if j - eta - 1 >= 0 else 0.0
        prev = T[j - 1] if j >= 1 else 0.0
        T.append(max(prev, submit + d) + t)
    return T


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
@pytest.mark.parametrize("d,t", [(1.0, 0.5), (1.0, 0.2), (0.5, 1.0)])
def test_areal_staleness_capacity_alone(eta, d, t):
    """With max_concurrent_rollouts large and slots to spare, only (eta + v + 1) * B - (accepted +
    running) limits submission: every step ends where the recurrence puts it."""
    p, res, _ = run("areal", wl(staleness=eta, median=d, train_time=t, slots=1000, areal_max_concurrent_rollouts=1000))
    assert p.rec.step_ends == pytest.approx(_areal_step_ends(eta, d, t, K))
    assert res.staleness_max == min(eta, K)  # constant times: no straggler, the bound holds exactly


def test_areal_default_concurrency_is_the_batch_size():
    """max_concurrent_rollouts defaults to consumer_batch_size = B: with 1000 slots and eta = 1 at most
    B groups run at once, so a batch takes d and the period is max(d, t) = 1, not (d + t) / 2 = 0.75."""
    p, res, _ = run("areal", wl(staleness=1, slots=1000))
    assert max_running_groups(p) == 4
    assert period(res) == pytest.approx(1.0)
    p8, res8, _ = run("areal", wl(staleness=1, slots=1000, areal_max_concurrent_rollouts=8))
    assert max_running_groups(p8) == 8
    assert period(res8) == pytest.approx(0.75)  # = (d + t) / (eta + 1), the staleness capacity's limit


def test_areal_hands_out_oldest_submitted_first():
    """B = 1, N = 1, 3 slots, eta = 2, trace 2.0, 1.0, 1.5: groups 0, 1, 2 are submitted at t = 0 and
    finish at 2.0, 1.0, 1.5. Step 0 takes group 1 (the only one done at t = 1) and trains until 3;
    then groups 0 and 2 are both done and AReaL's wait_results sorts by create_time: group 0 first."""
    w = wl(
        slots=3,
        steps=3,
        staleness=2,
        batch_size=1,
        redundant_batch_size=1,
        group_size=1,
        redundant_group_size=1,
        dist="trace",
        trace=(2.0, 1.0, 1.5),
        train_time=2.0,
        areal_max_concurrent_rollouts=3,
    )
    _, _, trained = run("areal", w)
    assert [b for b, _ in trained[:3]] == [[1], [0], [2]]
    # a completion-order queue (discard_requeue with enough workers) would take group 2 before group 0
    _, _, fifo = run("discard_requeue", w.replace(tinker_groups_per_batch=3))
    assert [b for b, _ in fifo[:3]] == [[1], [2], [0]]


def test_areal_weight_update_pauses_generation_and_blocks_the_trainer():
    """eta = 1, S = B*N, d = 1, t = 0.5, s = 0.25. The batch generating while step j trains is paused
    for the sync after it (rl_trainer: rollout.pause(); update_weights pauses generation), so the
    period is d + s = 1.25; the trainer trains 0.5 of it."""
    _, res, _ = run("areal", wl(sync_time=0.25))
    assert period(res) == pytest.approx(1.25)
    assert res.trainer_idle == pytest.approx(1 - 0.5 / 1.25)
    assert res.generator_idle == pytest.approx(1 - 1.0 / 1.25)
    assert res.staleness_max == 1


# ---------------------------------------------------------------------------------------- Tinker


def test_tinker_workers_fix_the_concurrency():
    """groups_per_batch worker coroutines, one group each: 2 workers for B = 4 generate a batch in
    2 d; the default (B workers) in d."""
    p, res, _ = run("discard_requeue", wl(slots=1000, tinker_groups_per_batch=2))
    assert max_running_groups(p) == 2
    assert period(res) == pytest.approx(2.0)
    p4, res4, _ = run("discard_requeue", wl(slots=1000))
    assert max_running_groups(p4) == 4
    assert period(res4) == pytest.approx(1.0)


def test_tinker_has_no_admission_cap_and_drops_stale_groups():
    """B workers, d = 1 < t = 2.5, eta = 1: a wave of B groups finishes every second whatever the
    trainer does. Step 0 trains wave 0 (V 0) over [1, 3.5]; at version 1 wave 1 (V 0) is 1 stale:
    trained over [3.5, 6]. At version 2 waves 2 and 3 (V 0) are 2 stale: dropped and requeued; wave 4
    (launched at 4 with V 1) is trained over [6, 8.5]. So the trainer never waits (period t), every
    trained batch after the first is exactly 1 stale, and the launched count grows with time, not
    with the steps."""
    p, res, trained = run("discard_requeue", wl(train_time=2.5))
    assert period(res) == pytest.approx(2.5)
    assert res.trainer_idle == pytest.approx(0.0, abs=1e-12)
    assert [v - p.t_ver[b[0]] for b, v in trained] == [0] + [1] * (K - 1)
    assert trained[2][0][0] == 4 * 4 * 2  # the first trajectory of wave 4 (waves of B*N = 8 launches)
    assert res.violations == 0 and res.discarded_fraction > 0.5
    assert len(p.t_drawn) == pytest.approx(8 * p.now, abs=8)  # 8 launches per second until the end


def test_tinker_sync_blocks_the_trainer_not_generation():
    """The training loop awaits the new sampling client (s = 0.25); the workers keep sampling: with
    d = 1, t = 0.5 the period stays d (generation-bound), while AReaL's pausing sync gives d + s."""
    _, res, _ = run("discard_requeue", wl(sync_time=0.25))
    assert period(res) == pytest.approx(1.0)
    assert res.trainer_idle == pytest.approx(1 - 0.5 / 1.0)

    # t = 1, s = 0.25: a step needs 1.25 s but a wave (V = the version at its launch) lands every
    # second, so waves go stale. Step 2 starts at 3.5 at version 2: wave 2 (launched at 2, V 0) is
    # dropped and wave 3 (launched at 3, V 1) is waited for until 4; step 3 takes wave 4 (V 2) at 5.25;
    # at 6.5 wave 5 (V 2) is dropped and wave 6 waited for until 7. Two steps per 3 s.
    _, slow, _ = run("discard_requeue", wl(sync_time=0.25, train_time=1.0))
    assert period(slow) == pytest.approx(1.5)
    assert slow.staleness_max == 1 and slow.discarded_fraction > 0


# ---------------------------------------------------------------------------------------- verl


@pytest.mark.parametrize(
    "B,thr,k,want",
    [(4, 0.1, 4, 17), (4, 0.6, 1, 6), (16, 0.1, 4, 70), (10, 0.1, 1, 11), (4, 0.0, 2, 8), (4, 1.0, 1, 8)],
)
def test_verl_budget_is_truncated_like_verl(B, thr, k, want):
    """max_required_samples = int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step):
    4 * 1.1 * 4 = 17.6 -> 17, 4 * 1.6 = 6.4 -> 6, 16 * 1.1 * 4 = 70.4 -> 70."""
    assert verl_max_required_samples(B, thr, k) == want
    # the rollouter submits exactly that many samples before its first sync (1 step, 1000 slots,
    # concurrency cap 1000): all are launched at once or as the first ones finish
    w = wl(
        slots=1000,
        steps=1,
        batch_size=B,
        redundant_batch_size=B,
        verl_staleness_threshold=thr,
        verl_trigger_parameter_sync_step=k,
        verl_max_concurrent_samples=1000,
        train_time=5.0,
    )
    p, _, _ = run("sample_budget", w)
    assert p.n_groups == want


def test_verl_concurrency_cap():
    """max_concurrent_samples = 2 with B = 4 and 1000 slots: two groups at a time, a batch every 2 d."""
    p, res, _ = run(
        "sample_budget",
        wl(slots=1000, verl_max_concurrent_samples=2, verl_trigger_parameter_sync_step=1, verl_staleness_threshold=1.0),
    )
    assert max_running_groups(p) == 2
    assert period(res) == pytest.approx(2.0)


def test_verl_syncs_every_k_steps_and_only_those_block_the_trainer():
    """Trainer-bound (t = 2, d = 0.1), k = 2, s = 0.5: two steps take 2 t + s, and every V_traj is a
    multiple of k (staleness counted in syncs: the generators only ever hold versions 0, 2, 4, ...)."""
    p, res, _ = run(
        "sample_budget",
        wl(
            median=0.1,
            train_time=2.0,
            sync_time=0.5,
            verl_trigger_parameter_sync_step=2,
            verl_staleness_threshold=1.0,
            steps=K,
        ),
    )
    ends = p.rec.step_ends
    gaps = [round(b - a, 9) for a, b in zip(ends[1:], ends[2:])]
    assert set(gaps) == {2.0, 2.5}
    assert set(p.t_ver) <= set(range(0, K + 1, 2))


def test_verl_sync_pauses_the_rollouter():
    """k = 1, budget 2B, S = B*N, d = 1, t = 0.5, s = 0.25: the batch in flight while step j trains
    stops for the sync (partial rollout) and resumes after it: period d + s = 1.25."""
    _, res, _ = run(
        "sample_budget", wl(sync_time=0.25, verl_trigger_parameter_sync_step=1, verl_staleness_threshold=1.0)
    )
    assert period(res) == pytest.approx(1.25)


# ---------------------------------------------------------------------------------------- one-step-off


@pytest.mark.parametrize("d,t,s", [(1.0, 0.5, 0.0), (1.0, 0.5, 0.25), (1.0, 2.0, 0.25), (2.0, 0.5, 1.0)])
def test_one_step_off_sync_blocks_the_trainer(d, t, s):
    """verl one_step_off fit(): wait for batch j, sync (blocking), launch batch j+1, train batch j:
    period s + max(d, t), staleness exactly 1 after the first batch."""
    p, res, trained = run("one_step_off", wl(median=d, train_time=t, sync_time=s))
    assert period(res) == pytest.approx(s + max(d, t))
    assert res.trainer_idle == pytest.approx(1 - t / (s + max(d, t)))
    assert [v - p.t_ver[b[0]] for b, v in trained] == [0] + [1] * (K - 1)


# ---------------------------------------------------------------------------------------- config


def test_peer_knobs_are_read_from_their_own_keys():
    cfg = load_config(
        None,
        [
            "sim.areal.max_concurrent_rollouts=7",
            "sim.tinker.groups_per_batch=3",
            "sim.verl.staleness_threshold=0.5",
            "sim.verl.trigger_parameter_sync_step=2",
            "sim.verl.max_concurrent_samples=9",
        ],
    )
    w = Workload.from_config(cfg)
    assert (
        w.areal_max_concurrent_rollouts,
        w.tinker_groups_per_batch,
        w.verl_staleness_threshold,
        w.verl_trigger_parameter_sync_step,
        w.verl_max_concurrent_samples,
    ) == (7, 3, 0.5, 2, 9)
    d = Workload.from_config(load_config(None, []))
    assert (
        d.areal_max_concurrent_rollouts,
        d.tinker_groups_per_batch,
        d.verl_staleness_threshold,
        d.verl_trigger_parameter_sync_step,
        d.verl_max_concurrent_samples,
    ) == (None, None, 0.1, 4, 16)


def test_old_sync_step_key_names_the_new_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sim.trigger_parameter_sync_step=2"])
    assert "sim.verl.trigger_parameter_sync_step" in str(e.value)


def test_pareto_takes_alpha_and_rejects_sigma():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sim.gen_time.dist=pareto", "sim.gen_time.sigma=1.5"])
    assert "sim.gen_time.alpha" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sim.gen_time.dist=pareto", "sim.gen_time.alpha=1.0"])
    assert "sim.gen_time.alpha" in str(e.value)
    w = Workload.from_config(
        load_config(None, ["sim.gen_time.dist=pareto", "sim.gen_time.alpha=3", "sim.gen_time.median=2"])
    )
    xm = 2 / 2 ** (1 / 3)
    assert w.alpha == 3 and w.mean_gen_time() == pytest.approx(3 * xm / 2)
    assert Workload.from_config(load_config(None, [])).sigma == 1.0  # lognormal's default


def test_psrl_sync_neither_blocks_nor_pauses():
    """psrl keeps its own sync model (the trainer goes on; the generators get the weights s later):
    eta = 1, d = 1, t = 0.5, s = 0.25 runs at period d."""
    _, res, _ = run("psrl", wl(sync_time=0.25))
    assert period(res) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- psrl what-if


def _truncations(w):
    """(time, trajectory, trainer busy?) of every truncation, and the training start times."""
    p = POLICIES["psrl"](w)
    cuts, starts = [], []
    orig_t, orig_s = p.truncate, p.start_training
    p.truncate = lambda i: (cuts.append((p.now, i, p.trainer_busy)), orig_t(i))
    p.start_training = lambda b, v: (starts.append(p.now), orig_s(b, v))
    p.run()
    return cuts, starts


@pytest.mark.parametrize("grace", [0.0, 0.5, 1.25, 2.5])
def test_proactive_scope_head_cuts_only_while_the_trainer_waits(grace):
    """B = 2, N = 1, 4 slots, eta = 1, trace 1, 1, 1, 10, then 1 s each; train 3 s; truncate at threshold 1.
    At t = 1 three groups are done and the trainer waits on the 10 s one: the head scope cuts it once the
    trainer has waited the grace for buffer 0 -- since t = 0, the start, as psrl train's trainer has -- so at
    t = max(1, grace), and that step starts then. The window scope also acts on later buffers while the
    trainer is busy (a cut at t = 5 during the step 4-7); the head scope never does."""
    base = dict(
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
    )
    cuts, starts = _truncations(wl(**base, proactive_scope="head", proactive_grace=grace))
    assert cuts == [(pytest.approx(max(1.0, grace)), 3, False)]
    assert starts[0] == pytest.approx(max(1.0, grace))
    window, _ = _truncations(wl(**base))
    assert any(busy for _, _, busy in window)


# ---------------------------------------------------------------------------------------- invariants


@st.composite
def peer_workloads(draw):
    B = draw(st.integers(1, 4))
    N = draw(st.integers(1, 3))
    return Workload(
        slots=draw(st.integers(N, 16)),
        steps=draw(st.integers(1, 8)),
        staleness=draw(st.integers(0, 3)),
        batch_size=B,
        redundant_batch_size=B,
        group_size=N,
        redundant_group_size=N,
        dist=draw(st.sampled_from(["lognormal", "pareto", "constant"])),
        median=draw(st.floats(0.1, 3.0)),
        sigma=draw(st.floats(0.1, 2.0)),
        alpha=draw(st.floats(1.1, 3.0)),
        train_time=draw(st.floats(0.0, 3.0)),
        sync_time=draw(st.sampled_from([0.0, 0.3, 1.0])),
        filter_drop_rate=draw(st.sampled_from([0.0, 0.3])),
        areal_max_concurrent_rollouts=draw(st.sampled_from([None, 1, 3, 100])),
        tinker_groups_per_batch=draw(st.sampled_from([None, 1, 3])),
        verl_staleness_threshold=draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])),
        verl_trigger_parameter_sync_step=draw(st.integers(1, 3)),
        verl_max_concurrent_samples=draw(st.sampled_from([1, 2, 16])),
        seed=draw(st.integers(0, 1000)),
    )


def _checked(policy, w, check):
    """Run ``policy`` on ``w`` calling ``check(p)`` right after every admitted group and every launch."""
    p = POLICIES[policy](w)
    nxt, launch = p.next_group, p.launch

    def next_group():
        g = nxt()
        if g is not None:
            check(p)
        return g

    def checked_launch(g):
        assert not p.gen_paused  # nothing starts while a sync pauses generation
        return launch(g)

    p.next_group, p.launch = next_group, checked_launch
    res = p.run()
    assert res.trained_trajectories == w.steps * w.batch_size * w.group_size
    return p, res


@settings(max_examples=60, deadline=None)
@given(peer_workloads())
def test_areal_admission_never_exceeds_either_capacity(w):
    """After every submission: running <= max_concurrent_rollouts and accepted + running <= (eta + v + 1) * B."""

    def check(p):
        assert p.running <= p.max_concurrent
        assert p.accepted + p.running <= (p.eta + p.gen_version + 1) * w.batch_size

    _checked("areal", w, check)


@settings(max_examples=60, deadline=None)
@given(peer_workloads())
def test_tinker_never_runs_more_groups_than_workers_and_never_violates(w):
    def check(p):
        assert p.running <= p.workers

    _, res = _checked("discard_requeue", w, check)
    assert res.violations == 0


@settings(max_examples=60, deadline=None)
@given(peer_workloads())
def test_verl_never_exceeds_budget_or_concurrency_and_syncs_every_k(w):
    def check(p):
        assert p.submitted <= p.budget and p.running <= p.max_concurrent

    p, _ = _checked("sample_budget", w, check)
    assert all(v % w.verl_trigger_parameter_sync_step == 0 for v in p.t_ver)


@settings(max_examples=60, deadline=None)
@given(peer_workloads())
def test_one_step_off_is_exactly_one_stale(w):
    _, res = _checked("one_step_off", w, lambda p: None)
    assert res.staleness_max == (1 if w.steps > 1 else 0)
