"""The simulator's divergence model (``sim.divergence``) and psrl train's staleness controller
(``psrl.adaptive_staleness``) in simulated runs, in virtual time."""

import pytest

from psrl.config import AdaptiveStalenessConfig, ConfigError, load_config
from psrl.sim import Workload, simulate
from psrl.sim.divergence import DivergenceModel
from psrl.sim.psrl_policy import PsrlPolicy

# generation-bound: the trainer (0.05 s) waits for 64 slots of ~1 s trajectories; a larger bound is faster
GEN_BOUND = Workload(slots=32, batch_size=4, redundant_batch_size=4, group_size=4, redundant_group_size=4,
                     sigma=0.5, train_time=0.05, steps=80, staleness=4)  # fmt: skip


def _adaptive(**kw) -> AdaptiveStalenessConfig:
    return AdaptiveStalenessConfig(enable=True, every=2, **kw)


def test_divergence_grows_with_the_lag_and_is_none_at_lag_zero():
    m = DivergenceModel()
    none = {"divergence/ess": 1.0, "divergence/m2": 0.0, "divergence/kl": 0.0}
    assert m.batch([0, 0]) == {**none, **{f"{k}@s0": v for k, v in none.items()}, "staleness/tokens@s0": 1.0}
    rows = [m.batch([d]) for d in range(9)]
    for a, b in zip(rows, rows[1:]):
        assert b["divergence/ess"] < a["divergence/ess"]
        assert b["divergence/m2"] > a["divergence/m2"] and b["divergence/kl"] > a["divergence/kl"]
    # the learning-rate factor scales the lag: lr_scale 2 at lag 1 is lag 2 at lr_scale 1
    assert DivergenceModel(lr_scale=2.0).batch([1])["divergence/m2@s1"] == pytest.approx(m.batch([2])["divergence/m2"])
    # a batch is the mean over its trajectories of (lr_scale x lag)^2; per lag, as the trainer reports it
    mixed = m.batch([0, 2, 2, 2])
    assert mixed["divergence/kl"] == pytest.approx(m.kl_coef * 3.0)
    assert mixed["divergence/kl@s2"] == pytest.approx(m.kl_coef * 4.0) and mixed["staleness/tokens@s2"] == 0.75


def test_default_coefficients_reproduce_the_tiny_models_measured_divergence():
    """docs/learning.md, agentic task, default corrections, fixed bounds 2 and 8 over 5 seeds: the means of the step
    rows' per-lag figures (``divergence/*@s{d}``) at lags 2, 3 and 4."""
    m = DivergenceModel()
    at2, at3, at4 = m.batch([2]), m.batch([3]), m.batch([4])
    assert at2["divergence/ess"] == pytest.approx(0.972, abs=0.01)
    assert at4["divergence/ess"] == pytest.approx(0.914, abs=0.01)
    assert at3["divergence/m2"] == pytest.approx(0.133, rel=0.1)
    assert at2["divergence/kl"] == pytest.approx(0.0142, rel=0.1)
    assert at4["divergence/kl"] == pytest.approx(0.0677, rel=0.2)


def test_sim_divergence_keys_are_read_and_validated():
    cfg = load_config(None, ["sim.divergence.lr_scale=1.6", "psrl.adaptive_staleness.enable=true"])
    wl = Workload.from_config(cfg)
    assert wl.divergence.lr_scale == 1.6 and wl.adaptive.enable
    with pytest.raises(ConfigError, match="sim.divergence.kl_coef"):
        load_config(None, ["sim.divergence.kl_coef=-1"])


def test_fixed_bound_rows_carry_the_models_divergence():
    res = simulate(GEN_BOUND.replace(staleness=2), "psrl")
    assert res.extra["staleness/bound"] == 2 and res.extra["staleness/bound_moves"] == 0
    # generation-bound at a fixed bound: batches train at (about) the bound's lag
    assert 0.9 < res.extra["divergence/ess"] < 1.0 and res.extra["divergence/kl"] > 0


@pytest.mark.parametrize("policy", ["psrl", "coordinator"])
def test_controller_raises_the_bound_while_the_trainer_idles_and_divergence_is_low(policy):
    wl = GEN_BOUND.replace(adaptive=_adaptive(ess_min=0.0, m2_max=100.0, kl_max=100.0))
    res = simulate(wl, policy)
    assert res.policy == f"{policy}+adaptive"
    assert res.extra["staleness/bound_final"] == 4  # from start 1 to the ceiling, one step per window
    assert res.extra["staleness/bound_moves"] == 3
    fixed = simulate(GEN_BOUND, policy)
    assert res.steps_per_hour > 0.9 * fixed.steps_per_hour  # reaches the ceiling's throughput


@pytest.mark.parametrize("policy", ["psrl", "coordinator"])
def test_controller_lowers_the_bound_when_the_divergence_model_leaves_the_limits(policy):
    # kl at lag 1 is 0.0036, at lag 2 0.0144: a limit between holds the bound about 1-2 (a raise shows in the
    # divergence a window late, so it may overshoot by one), below the ceiling 4
    wl = GEN_BOUND.replace(adaptive=_adaptive(kl_max=0.01, ess_min=0.0, m2_max=100.0))
    sim = PsrlPolicy(wl) if policy == "psrl" else None
    res = sim.run() if sim is not None else simulate(wl, policy)
    assert res.extra["staleness/bound"] < 2.5 and res.extra["staleness/bound_final"] <= 3
    assert res.extra["staleness/bound_moves"] > 4  # up and down again
    if sim is not None:
        bounds = [r["staleness/bound"] for r in sim.log.rows]
        assert max(bounds) <= 3 and any(b < a for a, b in zip(bounds, bounds[1:]))
    # the same workload without the controller trains at the ceiling, out of the limit
    assert simulate(GEN_BOUND, policy).extra["divergence/kl"] > 0.01


class _Audited(PsrlPolicy):
    """Checks, for every trained trajectory, lag <= the bound in force when its group was reserved."""

    def __init__(self, wl):
        super().__init__(wl)
        self.bound_at: dict[int, int] = {}
        self.checked = 0

    def next_group(self):
        g = super().next_group()
        if g is not None:
            self.bound_at[g.ordinal] = self.m.staleness
        return g

    def start_training(self, batch, version):
        for idx in batch:
            assert version - self.t_ver[idx] <= self.bound_at[self.t_group[idx].ordinal]
            self.checked += 1
        super().start_training(batch, version)


def test_staleness_audit_stays_clean_with_the_controller_moving_the_bound():
    wl = GEN_BOUND.replace(steps=120, adaptive=_adaptive(kl_max=0.03, ess_min=0.0, m2_max=100.0))
    sim = _Audited(wl)
    res = sim.run()
    assert sim.checked == res.trained_trajectories > 0
    assert res.extra["staleness/bound_moves"] > 4 and res.violations == 0


def test_simulate_adaptive_prints_the_controller_beside_the_fixed_bounds(capsys):
    from psrl.sim.cli import main

    args = ["sim.slots=32", "sim.steps=40", "sim.train_time=0.05", "psrl.staleness_buffer_entries=4"]
    assert main([*args, "--policies", "psrl", "--sweep", "psrl.staleness=1,3", "--adaptive"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()]
    assert [ln[:2] for ln in lines if ln and ln[0].startswith("psrl")][:4] == [
        ["psrl", "1"],
        ["psrl+adaptive", "1"],
        ["psrl", "3"],
        ["psrl+adaptive", "3"],
    ]
    assert "divergence (sim.divergence; limits of psrl.adaptive_staleness" in out
    assert main([*args, "--policies", "sync", "--adaptive"]) == 2
    assert "--adaptive" in capsys.readouterr().err
