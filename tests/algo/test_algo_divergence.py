"""The divergence statistics (divergence/ess, m2, kl, per staleness level, the token histogram) against a slow
reference written as plain loops over lists, on random batches; and their sums add up across any split of the
batch (the reduction a batch split over trainer ranks will use)."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.algo.divergence import (
    LOG_RATIO_CLAMP,
    divergence_metrics,
    divergence_row,
    divergence_sums,
    level_sums,
    reduce_sums,
    token_log_ratio,
    weight_sums,
)


def ref_stats(ds: list[float]) -> dict[str, float]:
    """ESS, M2 and k3-KL of token log-ratios ``ds``, one loop each, straight from the definitions."""
    n = len(ds)
    if n == 0:
        return {"ess": 1.0, "m2": 0.0, "kl": 0.0}
    s1 = s2 = m2 = kl = 0.0
    for d in ds:
        w = math.exp(d)
        s1 += w
        s2 += w * w
        m2 += d * d
        kl += w - 1.0 - d
    return {"ess": s1 * s1 / (n * s2), "m2": m2 / n, "kl": kl / n}


def ref_metrics(old: list[list[float]], behav: list[list[float]], mask: list[list[float]], lag: list[int]) -> dict:
    """The metric row: whole batch, each staleness level that holds valid tokens, and the token histogram."""
    by_level: dict[int, list[float]] = {}
    every: list[float] = []
    for i in range(len(old)):
        for o, b, m in zip(old[i], behav[i], mask[i]):
            if m > 0:
                d = min(max(o - b, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
                by_level.setdefault(lag[i], []).append(d)
                every.append(d)
    row = {f"divergence/{k}": v for k, v in ref_stats(every).items()}
    for level, ds in by_level.items():
        row.update({f"divergence/{k}@s{level}": v for k, v in ref_stats(ds).items()})
        row[f"staleness/tokens@s{level}"] = len(ds) / len(every)
    return row


@st.composite
def batches(draw, lo: float = -8.0):
    """``(old, behav, mask, lag)``: a ragged ``[B, T]`` batch of log-probs in [lo, 0] with a staleness per row."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 6))
    logp = st.floats(lo, 0.0, allow_nan=False)
    old = [[draw(logp) for _ in range(t)] for _ in range(b)]
    behav = [[draw(logp) for _ in range(t)] for _ in range(b)]
    mask = [[float(draw(st.booleans())) for _ in range(t)] for _ in range(b)]
    lag = [draw(st.integers(0, 3)) for _ in range(b)]
    return old, behav, mask, lag


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _close(row: dict, ref: dict) -> None:
    assert row.keys() == ref.keys()
    for k in ref:
        assert row[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-6), k


@settings(max_examples=150, deadline=None)
@given(batches())
def test_metrics_match_the_slow_reference(batch):
    """Every key (levels present only where they hold valid tokens) equals the loop reference within 1e-6."""
    old, behav, mask, lag = batch
    _close(divergence_metrics(_t(old), _t(behav), _t(mask), torch.tensor(lag)), ref_metrics(old, behav, mask, lag))


@settings(max_examples=40, deadline=None)
@given(batches(lo=-60.0))
def test_clamped_ratios_stay_finite_and_match(batch):
    """Log-prob gaps beyond +-20 are clamped the same way in both, and nothing overflows."""
    old, behav, mask, lag = batch
    row = divergence_metrics(_t(old), _t(behav), _t(mask), torch.tensor(lag))
    assert all(math.isfinite(v) for v in row.values())
    _close(row, ref_metrics(old, behav, mask, lag))


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_sums_of_any_split_reduce_to_the_whole_batch(batch, data):
    """Rows dealt to 'ranks' at random, each rank's per-level sums, added level by level, give the batch's row:
    the statistics are ratios of sums, so splitting the batch over trainer ranks cannot change them."""
    old, behav, mask, lag = batch
    d, valid = token_log_ratio(_t(old), _t(behav), _t(mask))
    lags = torch.tensor(lag)
    ranks = [data.draw(st.integers(0, 2)) for _ in old]
    per_rank = []
    for r in range(3):
        rows = torch.tensor([x == r for x in ranks])
        per_rank.append(level_sums(d[rows], valid[rows], lags[rows]))
    merged = {k: reduce_sums(p[k] for p in per_rank if k in p) for k in {k for p in per_rank for k in p}}
    _close(divergence_row(merged), divergence_row(level_sums(d, valid, lags)))


def test_on_policy_is_one_zero_zero_and_empty_is_neutral():
    """Behaviour == pre-update policy: ESS 1, M2 0, KL 0 exactly; a batch without valid tokens reports the same
    three figures and no level (nothing to histogram)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    lag = torch.tensor([0, 2])
    row = divergence_metrics(old, old.clone(), torch.ones_like(old), lag)
    neutral = {"divergence/ess": 1.0, "divergence/m2": 0.0, "divergence/kl": 0.0}
    assert row == {
        **neutral,
        **{f"{k}@s{s}": v for s in (0, 2) for k, v in neutral.items()},
        "staleness/tokens@s0": 0.5,
        "staleness/tokens@s2": 0.5,
    }
    assert divergence_metrics(old, old - 1.0, torch.zeros_like(old), lag) == neutral


def test_one_dominant_weight_gives_ess_one_over_n():
    """Token weights e^20 against e^-20: one token holds the weight, ESS ~ 1/n."""
    n = 8
    old = torch.full((1, n), -40.0)
    old[0, 3] = 0.0
    behav = torch.full((1, n), -20.0)
    row = divergence_metrics(old, behav, torch.ones_like(old), torch.tensor([1]))
    assert row["divergence/ess"] == pytest.approx(1 / n, rel=1e-9)


def _ref_ess(logs: list[float]) -> float:
    """ESS of weights exp(l) with 60-digit decimals: no shift, no overflow, obviously right."""
    with localcontext() as ctx:
        ctx.prec = 60
        w = [Decimal(x).exp() for x in logs]
        return float(sum(w) ** 2 / (len(w) * sum(x * x for x in w)))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-3000.0, 3000.0, allow_nan=False), min_size=1, max_size=12), st.integers(1, 4))
def test_weight_sums_of_huge_log_weights_match_exact_arithmetic(logs, parts):
    """Sequence log-weights of thousands of nats: the shifted sums, split in ``parts`` and merged, give the ESS
    of exact arithmetic."""
    x = torch.tensor(logs, dtype=torch.float64)
    merged = weight_sums(x[:0])
    for chunk in x.tensor_split(parts):
        merged = merged + weight_sums(chunk)
    assert merged.ess == pytest.approx(_ref_ess(logs), rel=1e-6, abs=1e-6)
    assert weight_sums(x).ess == pytest.approx(_ref_ess(logs), rel=1e-6, abs=1e-6)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        divergence_sums(*token_log_ratio(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)))
