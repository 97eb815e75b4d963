"""The adaptive staleness controller: its rule on windows of step rows (settle and hold included), against a slow
statement of it."""

import dataclasses
import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from psrl.config import AdaptiveStalenessConfig, ConfigError, load_config
from psrl.runtime.adaptive import StalenessController, idle_fraction, lowered, within_bound
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


def per_lag_row(levels, step_s, train_s, publish_s):
    """A row as :func:`psrl.algo.divergence.divergence_row` writes it: per lag k (token weight, ess, m2, kl), the
    shares normalised; the batch's m2 and kl the token means, its ess the token-weighted mean."""
    total = sum(v[0] for v in levels.values())
    r = row(0, step_s, train_s, publish_s)
    for k, (f, ess, m2, kl) in levels.items():
        r[f"staleness/tokens@s{k}"] = f / total
        r.update({f"divergence/ess@s{k}": ess, f"divergence/m2@s{k}": m2, f"divergence/kl@s{k}": kl})
    for name, j in (("ess", 1), ("m2", 2), ("kl", 3)):
        r[f"divergence/{name}"] = sum(v[0] * v[j] for v in levels.values()) / total
    return r


def controller(cfg=CFG, ceiling=3):
    m = StalenessManager(ceiling, 1, 1, max_staleness=ceiling)
    return StalenessController(cfg, ceiling, m.set_staleness), m


def test_it_rises_one_per_window_while_the_trainer_idles_up_to_the_ceiling():
    c, m = controller()
    assert c.bound == m.staleness == 1
    moves = [c.observe(row(s)) for s in range(1, 9)]  # idle 0.4 of every step, divergence inside
    # after the move from 1 the next row (step 3) may train data reserved under 1: its window (3-4) cannot raise
    assert [(mv.step, mv.old, mv.new) for mv in moves if mv] == [(2, 1, 2), (6, 2, 3)]
    assert moves[0] is None and m.staleness == 3 and "idle 0.40 >= idle_frac 0.2" in moves[1].reason


def test_it_starts_at_start_taken_into_min_and_the_ceiling():
    assert controller(dataclasses.replace(CFG, min=0, start=0))[0].bound == 0
    assert controller(dataclasses.replace(CFG, min=2, start=1))[0].bound == 2  # not below min
    c, m = controller(dataclasses.replace(CFG, min=0, start=5), ceiling=3)
    assert c.bound == m.staleness == 3  # not above the ceiling
    assert load_config(None, ["psrl.adaptive_staleness.enable=true"]).psrl.adaptive_staleness.start == 1
    with pytest.raises(ConfigError, match="psrl.adaptive_staleness.start"):
        load_config(None, ["psrl.adaptive_staleness.start=-1"])


def test_a_busy_trainer_keeps_the_bound():
    c, m = controller()
    assert [c.observe(row(s, train_s=0.95, publish_s=0.0)) for s in range(1, 7)] == [None] * 6
    assert m.staleness == 1


def test_the_bound_about_halves_when_the_divergence_leaves_its_limits():
    assert [lowered(b) for b in range(1, 10)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_divergence_outside_a_limit_lowers_the_bound_at_once_naming_the_figure_never_below_min():
    cfg = dataclasses.replace(CFG, min=0)
    c, m = controller(cfg, ceiling=8)
    c.load_state_dict({"bound": 8})
    steps = iter(range(1, 100))
    for key, value, name, new in (
        ("m2", 0.5, "divergence/m2 0.255 > m2_max 0.08", 4),
        ("ess", 0.5, "divergence/ess 0.745 < ess_min 0.95", 2),  # the window right after the move counts too
        ("kl", 0.5, "divergence/kl 0.255 > kl_max 0.025", 1),
        ("m2", 0.5, "divergence/m2 0.255 > m2_max 0.08", 0),
    ):
        c.observe(row(next(steps)))
        mv = c.observe(row(next(steps), **{key: value}))  # the window's mean is out of its limit
        assert mv.new == new == m.staleness and name in mv.reason
    c.observe(row(next(steps), kl=1.0))
    assert c.observe(row(next(steps), kl=1.0)) is None and m.staleness == 0  # min is the floor
    d, m = controller(dataclasses.replace(CFG, min=2), ceiling=8)
    d.load_state_dict({"bound": 3})
    d.observe(row(1, m2=1.0))
    assert d.observe(row(2, m2=1.0)).new == 2 == m.staleness  # halving stops at min


def lagged(step, levels, train_s=0.5, publish_s=0.1):
    """A step row whose batch holds ``levels``: ``{lag: (token fraction, m2)}`` (kl = m2 / 4, ess 0.99)."""
    r = per_lag_row({k: (f, 0.99, m2, m2 / 4) for k, (f, m2) in levels.items()}, 1.0, train_s, publish_s)
    return {**r, "step": step}


def test_within_bound_keeps_the_tokens_of_lag_up_to_the_bound():
    r = lagged(1, {1: (0.25, 0.02), 2: (0.25, 0.06), 3: (0.5, 0.5)})
    assert within_bound(r, 3) is r and within_bound(row(1), 0) is not None  # nothing above it / no per-lag figures
    assert within_bound(r, 2)["divergence/m2"] == pytest.approx(0.04)  # (0.25 x 0.02 + 0.25 x 0.06) / 0.5
    assert within_bound(r, 2)["divergence/kl"] == pytest.approx(0.01) and within_bound(r, 2)["divergence/ess"] == 0.99
    assert within_bound(lagged(1, {3: (1.0, 0.5)}), 2) is None  # it trained nothing of lag <= 2


def test_data_reserved_under_the_old_bound_does_not_lower_the_bound_again():
    c, m = controller(dataclasses.replace(CFG, min=0), ceiling=8)
    c.load_state_dict({"bound": 3})
    busy = {"train_s": 0.95, "publish_s": 0.0}  # no raise: only the way down is looked at
    c.observe(lagged(1, {3: (1.0, 0.3)}, **busy))
    assert c.observe(lagged(2, {3: (1.0, 0.3)}, **busy)).new == 2  # lag 3 is out of the limits: 3 -> 2
    # the next rows still train lag-3 data (out), and lag-2 data (in): judged on the latter, the bound stays
    c.observe(lagged(3, {2: (0.5, 0.04), 3: (0.5, 0.3)}, **busy))
    assert c.observe(lagged(4, {1: (0.2, 0.01), 2: (0.3, 0.04), 3: (0.5, 0.3)}, **busy)) is None
    c.observe(lagged(5, {2: (1.0, 0.2)}, **busy))  # its own data out: down
    assert c.observe(lagged(6, {2: (0.6, 0.2), 3: (0.4, 0.3)}, **busy)).new == 1 == m.staleness


def test_a_bound_left_for_divergence_is_retried_after_twice_as_many_windows_each_time():
    c, m = controller(ceiling=2)
    steps = iter(range(1, 1000))

    def window(**kw):
        return [c.observe(row(next(steps), **kw)) for _ in range(CFG.every)][-1]

    assert window().new == 2  # 1 -> 2 after one window
    assert window() is None  # it holds step 3, which may train data reserved under 1: no raise from it
    for hold in (2, 4, 8):
        assert window(m2=0.5).new == 1 and c.hold(2) == hold  # 2 is out: down, and 2's hold doubles
        assert window() is None  # the 2 rows after the move from 2
        for _ in range(hold - 1):
            assert window() is None and m.staleness == 1
        up = window()  # the hold-th window in a row rises again, saying so
        assert up.new == 2 and f"in {hold} windows in a row" in up.reason
        assert window() is None
    # a window that does not justify a raise (a busy trainer) restarts the count
    assert window(m2=0.5).new == 1 and c.hold(2) == 16
    assert window() is None
    for _ in range(15):
        assert window() is None
    assert window(train_s=0.95, publish_s=0.0) is None
    for _ in range(15):
        assert window() is None
    assert window().new == 2 and m.staleness == 2


def test_the_state_continues_the_same_judgement():
    c, _ = controller()
    for s, m2 in ((1, 0.01), (2, 0.01), (3, 0.5), (4, 0.5), (5, 0.01)):  # up, down (from a mixed window), one row
        c.observe(row(s, m2=m2))
    assert c.hold(2) == 2 and c.bound == 1
    d, m = controller()
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))  # it travels in the checkpoint's JSON
    assert d.bound == m.staleness == 1 and d.hold(2) == 2
    assert [d.observe(row(s)) for s in range(6, 16)] == [c.observe(row(s)) for s in range(6, 16)]


KEYS = ("ess", "m2", "kl")


def own_figures(r, bound):
    """The row's figures over its tokens of lag <= bound (all of them when it holds no larger lag or no per-lag
    figures), None when it holds none that young."""
    lags = {int(k.split("@s")[1]): f for k, f in r.items() if k.startswith("staleness/tokens@s")}
    if not lags or max(lags) <= bound:
        return {k: r[f"divergence/{k}"] for k in KEYS}
    keep = {k: f for k, f in lags.items() if k <= bound and f > 0}
    if not keep:
        return None
    return {name: sum(f * r[f"divergence/{name}@s{k}"] for k, f in keep.items()) / sum(keep.values()) for name in KEYS}


def reference_bound(cfg, ceiling, rows):
    """The rule in words: from start (taken into [min, ceiling]), per window of `every` rows, down to about half (not
    below min) if the mean over the window's rows of their own figures (tokens of lag <= the bound) has ess < ess_min
    or m2 > m2_max or kl > kl_max, and each such move from b doubles b's hold; else up by one (to the ceiling) if
    the waited fraction >= idle_frac in as many windows in a row as the next bound's hold, counting only windows
    none of whose rows is among the b rows after a move from b."""
    bound, hold, ready, first_clean = min(max(cfg.start, cfg.min), ceiling), {}, 0, 0
    for i in range(0, len(rows) - cfg.every + 1, cfg.every):
        w = rows[i : i + cfg.every]
        own = [f for f in (own_figures(r, bound) for r in w) if f is not None]
        mean = {k: sum(f[k] for f in own) / len(own) for k in KEYS} if own else {"ess": 1.0, "m2": 0.0, "kl": 0.0}
        total = sum(r["time/step_s"] for r in w)
        waited = total - sum(r["time/train_s"] + r["time/publish_s"] for r in w)
        old = bound
        if mean["ess"] < cfg.ess_min or mean["m2"] > cfg.m2_max or mean["kl"] > cfg.kl_max:
            ready = 0
            if bound > cfg.min:
                hold[bound] = 2 * hold.get(bound, 1)
                bound = max(cfg.min, min(bound - 1, (bound + 1) // 2))
        elif i < first_clean:
            pass
        elif max(0.0, waited) / total >= cfg.idle_frac and bound < ceiling:
            ready += 1
            if ready >= hold.get(bound + 1, 1):
                bound += 1
        else:
            ready = 0
        if bound != old:
            ready = 0
            first_clean = i + cfg.every + old  # rows before it may train data reserved under `old`
    return bound


def rows_of(ess, m2, kl, train_s):
    return st.builds(
        row,
        step=st.just(0),
        step_s=st.floats(0.1, 2.0),
        train_s=train_s,
        publish_s=st.floats(0.0, 0.5),
        ess=ess,
        m2=m2,
        kl=kl,
    )


# calm rows (inside the default limits, the trainer mostly waiting) as often as rows anywhere: raises, settles, holds
# and halvings from 4 and above get exercised
level = st.one_of(  # (token weight, ess, m2, kl) of one lag: calm or anywhere
    st.tuples(st.floats(0.01, 1.0), st.floats(0.95, 1.0), st.floats(0.0, 0.08), st.floats(0.0, 0.025)),
    st.tuples(st.floats(0.01, 1.0), st.floats(0.5, 1.0), st.floats(0.0, 0.3), st.floats(0.0, 0.08)),
)
rows_st = st.lists(
    st.one_of(
        rows_of(st.floats(0.95, 1.0), st.floats(0.0, 0.08), st.floats(0.0, 0.025), st.floats(0.0, 0.05)),
        rows_of(st.floats(0.5, 1.0), st.floats(0.0, 0.3), st.floats(0.0, 0.08), st.floats(0.0, 1.5)),
        st.builds(  # with per-lag figures, lags up to 6: after a move down some lie above the bound
            per_lag_row,
            st.dictionaries(st.integers(0, 6), level, min_size=1, max_size=3),
            st.floats(0.1, 2.0),
            st.floats(0.0, 0.5),
            st.floats(0.0, 0.1),
        ),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(rows=rows_st, every=st.integers(1, 4), low=st.integers(0, 2), start=st.integers(0, 6), ceiling=st.integers(2, 5))
def test_the_controller_follows_the_rule_and_stays_within_min_and_the_ceiling(rows, every, low, start, ceiling):
    cfg = dataclasses.replace(CFG, every=every, min=low, start=start)
    c, m = controller(cfg, ceiling)
    seen = [m.staleness]
    for r in rows:
        c.observe(r)
        seen.append(m.staleness)
    assert all(low <= b <= ceiling for b in seen)
    assert all(b in (a, a + 1, max(low, lowered(a))) for a, b in zip(seen, seen[1:]))  # up one, or about halved
    assert c.bound == m.staleness == reference_bound(cfg, ceiling, rows)


def test_idle_fraction_of_a_window():
    assert idle_fraction([row(1, step_s=2.0, train_s=1.0, publish_s=0.5)]) == 0.25
    assert idle_fraction([]) == 0.0
