"""The adaptive staleness controller: its rule on windows of step rows, against a slow statement of it."""

import dataclasses

import hypothesis.strategies as st
from hypothesis import given, settings

from psrl.config import AdaptiveStalenessConfig
from psrl.runtime.adaptive import StalenessController, idle_fraction
from psrl.staleness import StalenessManager

CFG = AdaptiveStalenessConfig(enable=True, min=1, every=2)


def row(step, step_s=1.0, train_s=0.5, publish_s=0.1, ess=0.99, m2=0.01, kl=0.01):
    return {
        "step": step,
        "time/step_s": step_s,
        "time/train_s": train_s,
        "time/publish_s": publish_s,
        "divergence/ess": ess,
        "divergence/m2": m2,
        "divergence/kl": kl,
    }


def controller(cfg=CFG, ceiling=3):
    m = StalenessManager(ceiling, 1, 1, max_staleness=ceiling)
    return StalenessController(cfg, ceiling, m.set_staleness), m


def test_it_starts_at_min_and_rises_one_per_window_while_the_trainer_idles_up_to_the_ceiling():
    c, m = controller()
    assert c.bound == m.staleness == 1
    moves = [c.observe(row(s)) for s in range(1, 9)]  # idle 0.4 of every step, divergence inside
    assert [(mv.step, mv.old, mv.new) for mv in moves if mv] == [(2, 1, 2), (4, 2, 3)]
    assert moves[0] is None and m.staleness == 3 and "idle 0.40 >= idle_frac 0.2" in moves[1].reason


def test_a_busy_trainer_keeps_the_bound():
    c, m = controller()
    assert [c.observe(row(s, train_s=0.95, publish_s=0.0)) for s in range(1, 7)] == [None] * 6
    assert m.staleness == 1


def test_divergence_outside_a_limit_lowers_the_bound_naming_the_figure_never_below_min():
    c, m = controller()
    for s in range(1, 5):
        c.observe(row(s))
    assert m.staleness == 3
    for key, value, name in (
        ("m2", 0.5, "divergence/m2 0.255 > m2_max 0.15"),
        ("ess", 0.5, "divergence/ess 0.745 < ess_min 0.93"),
    ):
        c.observe(row(1))
        mv = c.observe(row(2, **{key: value}))  # the window's mean is out of its limit
        assert mv is not None and mv.new == mv.old - 1 and name in mv.reason
    assert m.staleness == 1
    c.observe(row(1, kl=1.0))
    assert c.observe(row(2, kl=1.0)) is None and m.staleness == 1  # min is the floor


def test_the_state_continues_the_same_judgement():
    c, _ = controller()
    c.observe(row(1))
    c.observe(row(2))
    c.observe(row(3))
    d, m = controller()
    d.load_state_dict(c.state_dict())
    assert d.bound == m.staleness == 2
    assert d.observe(row(4)) == c.observe(row(4))


def reference_bound(cfg, ceiling, rows):
    """The rule in words: per window of `every` rows, down if the mean ess < ess_min or m2 > m2_max or kl > kl_max
    (to min at least), else up if the waited fraction >= idle_frac (to the ceiling at most)."""
    bound = cfg.min
    for i in range(0, len(rows) - cfg.every + 1, cfg.every):
        w = rows[i : i + cfg.every]
        mean = {k: sum(r[f"divergence/{k}"] for r in w) / len(w) for k in ("ess", "m2", "kl")}
        total = sum(r["time/step_s"] for r in w)
        waited = total - sum(r["time/train_s"] + r["time/publish_s"] for r in w)
        if mean["ess"] < cfg.ess_min or mean["m2"] > cfg.m2_max or mean["kl"] > cfg.kl_max:
            bound = max(cfg.min, bound - 1)
        elif max(0.0, waited) / total >= cfg.idle_frac:
            bound = min(ceiling, bound + 1)
    return bound


rows_st = st.lists(
    st.builds(
        row,
        step=st.just(0),
        step_s=st.floats(0.1, 2.0),
        train_s=st.floats(0.0, 1.5),
        publish_s=st.floats(0.0, 0.5),
        ess=st.floats(0.5, 1.0),
        m2=st.floats(0.0, 0.3),
        kl=st.floats(0.0, 0.08),
    ),
    max_size=24,
)


@settings(max_examples=200, deadline=None)
@given(rows=rows_st, every=st.integers(1, 4), low=st.integers(0, 2), ceiling=st.integers(2, 5))
def test_the_controller_follows_the_rule_and_stays_within_min_and_the_ceiling(rows, every, low, ceiling):
    cfg = dataclasses.replace(CFG, every=every, min=low)
    c, m = controller(cfg, ceiling)
    seen = [m.staleness]
    for r in rows:
        c.observe(r)
        seen.append(m.staleness)
    assert all(low <= b <= ceiling for b in seen)
    assert all(abs(a - b) <= 1 for a, b in zip(seen, seen[1:]))
    assert c.bound == m.staleness == reference_bound(cfg, ceiling, rows)


def test_idle_fraction_of_a_window():
    assert idle_fraction([row(1, step_s=2.0, train_s=1.0, publish_s=0.5)]) == 0.25
    assert idle_fraction([]) == 0.0
