"""Rollout corrections (truncated IS, rejection sampling) against the plain-float reference,
at their boundaries, and on degenerate input (padding garbage, empty sequences, huge ratios)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.algo import rollout_correction
from tests.algo.algo_reference import ref_correction

IS_MODES = [None, "token", "sequence"]
RS_MODES = [None, "token", "sequence", "geometric"]
C, HI, LO = 1.3, 1.3, 0.8  # tight enough that every mode truncates / rejects part of the batch
SEEDS = [0, 1, 2]


def _random_batch(seed: int, B: int = 6, T: int = 7, spread: float = 0.6):
    """old/behav log-probs with ratios around 1, a ragged mask and one all-padding sequence."""
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = behav + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[B // 2] = 0.0
    return old, behav, mask


@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("rs_mode", RS_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_matches_reference(is_mode, rs_mode, seed):
    """Weights and keep-mask equal the reference for every IS x RS combination (thresholds
    chosen so that each mode both truncates/rejects and keeps something)."""
    old, behav, mask = _random_batch(seed)
    kw = dict(is_mode=is_mode, is_threshold=C, rs_mode=rs_mode, rs_threshold=HI, rs_threshold_lower=LO)
    w, keep, metrics = rollout_correction(old, behav, mask, **kw)
    rw, rk = ref_correction(old.tolist(), behav.tolist(), mask.tolist(), is_mode, C, rs_mode, HI, LO)
    assert torch.allclose(w, torch.tensor(rw, dtype=w.dtype), rtol=1e-10, atol=0)
    assert keep.tolist() == rk
    valid = mask > 0
    kept = keep > 0
    n_rho = [
        math.exp(o - b)
        for o, b, m in zip(old.flatten().tolist(), behav.flatten().tolist(), mask.flatten().tolist())
        if m
    ]
    assert metrics["correction/rho_mean"] == pytest.approx(sum(n_rho) / len(n_rho), rel=1e-9)
    assert metrics["correction/rs_masked_frac"] == pytest.approx(1 - kept.sum().item() / valid.sum().item())
    if kept.any():
        assert metrics["correction/is_weight_mean"] == pytest.approx(w[kept].mean().item(), rel=1e-9)
        assert metrics["correction/is_weight_max"] == pytest.approx(w[kept].max().item(), rel=1e-9)


def test_modes_actually_bite():
    """The thresholds used above truncate/reject part (not all) of some batch in every mode,
    else the comparison with the reference would be vacuous."""
    batches = [_random_batch(seed) for seed in SEEDS]
    for is_mode in ("token", "sequence"):
        fracs = [
            rollout_correction(*b, is_mode=is_mode, is_threshold=C)[2]["correction/is_truncated_frac"] for b in batches
        ]
        assert any(0 < f < 1 for f in fracs), (is_mode, fracs)
    for rs_mode in ("token", "sequence", "geometric"):
        kw = dict(rs_mode=rs_mode, rs_threshold=HI, rs_threshold_lower=LO)
        fracs = [rollout_correction(*b, **kw)[2]["correction/rs_masked_frac"] for b in batches]
        assert any(0 < f < 1 for f in fracs), (rs_mode, fracs)


def test_no_correction_is_identity_on_valid_tokens():
    """Without modes the weights are 1 and everything valid is kept (0 at padding)."""
    old, behav, mask = _random_batch(3)
    w, keep, m = rollout_correction(old, behav, mask, is_mode=None, rs_mode=None)
    assert torch.equal(w, mask) and torch.equal(keep, mask)
    assert m["correction/rs_masked_frac"] == 0.0 and m["correction/is_weight_mean"] == 1.0


def test_sequence_weight_is_broadcast_product():
    """Sequence IS: one weight per sequence = min(prod rho, C) over its valid tokens only."""
    old = torch.tensor([[0.1, 0.2, 9.0], [-0.5, 0.1, 0.0]], dtype=torch.float64)
    behav = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    w, _, _ = rollout_correction(old, behav, mask, is_mode="sequence", is_threshold=10.0)
    assert w[0, :2].tolist() == pytest.approx([math.exp(0.3)] * 2) and w[0, 2] == 0
    assert w[1].tolist() == pytest.approx([math.exp(-0.4)] * 3)


# ------------------------------------------------------------------ boundaries

LOG2 = math.log(2.0)


@pytest.mark.parametrize("rs_mode", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("log_rho", [LOG2, -LOG2])
def test_rs_bounds_are_inclusive(rs_mode, log_rho):
    """rho exactly at hi=2 or at the default lo=1/hi=0.5 is kept; one ulp beyond is rejected."""
    behav = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    at = torch.tensor([[log_rho]], dtype=torch.float64)
    beyond = torch.nextafter(at, at * 2)
    _, keep, _ = rollout_correction(at, behav, mask, rs_mode=rs_mode, rs_threshold=2.0)
    assert keep.item() == 1.0
    _, keep, m = rollout_correction(beyond, behav, mask, rs_mode=rs_mode, rs_threshold=2.0)
    assert keep.item() == 0.0 and m["correction/rs_masked_frac"] == 1.0


def test_geometric_is_length_independent_and_sequence_is_not():
    """Ten tokens of ratio 1.5: geometric mean 1.5 is inside [0.5, 2]; the product 57.7 is not."""
    old = torch.full((1, 10), math.log(1.5), dtype=torch.float64)
    behav, mask = torch.zeros_like(old), torch.ones_like(old)
    _, keep_geo, _ = rollout_correction(old, behav, mask, rs_mode="geometric", rs_threshold=2.0)
    _, keep_seq, _ = rollout_correction(old, behav, mask, rs_mode="sequence", rs_threshold=2.0)
    assert keep_geo.sum().item() == 10 and keep_seq.sum().item() == 0


@pytest.mark.parametrize("is_mode", ["token", "sequence"])
def test_is_weight_at_threshold(is_mode):
    """rho == C gives weight C and is not counted as truncated; rho above C gives exactly C."""
    behav = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    at = torch.tensor([[LOG2, 0.0]], dtype=torch.float64)
    w, _, m = rollout_correction(at, behav, mask, is_mode=is_mode, is_threshold=2.0)
    assert w[0, 0].item() == pytest.approx(2.0, rel=1e-15) and m["correction/is_truncated_frac"] == 0.0
    w, _, m = rollout_correction(at + 1.0, behav, mask, is_mode=is_mode, is_threshold=2.0)
    assert w[0, 0].item() == pytest.approx(2.0, rel=1e-15) and m["correction/is_truncated_frac"] == 1.0


@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("rs_mode", RS_MODES)
def test_degenerate_input_never_nan(is_mode, rs_mode):
    """All-padding rows, inf/nan garbage in padding, and huge valid log-ratios (a 1000-token
    sequence at +5 nats each) give finite weights, a 0/1 keep-mask and finite metrics."""
    old = torch.full((3, 1000), 5.0)
    behav = torch.zeros(3, 1000)
    mask = torch.ones(3, 1000)
    mask[1] = 0
    old[1] = float("inf")
    behav[1] = float("inf")
    mask[2, 3:] = 0
    old[2, 3:] = float("nan")
    w, keep, m = rollout_correction(old, behav, mask, is_mode=is_mode, rs_mode=rs_mode, is_threshold=2.0)
    assert torch.isfinite(w).all() and set(keep.unique().tolist()) <= {0.0, 1.0}
    assert (w[1] == 0).all() and (keep[1] == 0).all()
    assert all(math.isfinite(v) for v in m.values())
    w, keep, m = rollout_correction(old, behav, torch.zeros_like(mask), is_mode=is_mode, rs_mode=rs_mode)
    assert (w == 0).all() and (keep == 0).all() and all(v == 0.0 for v in m.values())


def test_inputs_are_detached():
    """The weights are constants of the loss: no graph leaks from old_logp."""
    old = torch.zeros(2, 3, requires_grad=True)
    w, keep, _ = rollout_correction(old, torch.zeros(2, 3), torch.ones(2, 3), is_mode="token", rs_mode="token")
    assert not w.requires_grad and not keep.requires_grad


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(is_mode="tok"), "rollout_correction.is"),
        (dict(rs_mode="geo"), "rollout_correction.rs"),
        (dict(is_threshold=0.0), "is_threshold"),
        (dict(rs_threshold=-1.0), "rs_threshold"),
        (dict(rs_threshold=2.0, rs_threshold_lower=3.0), "rs_threshold_lower"),
    ],
)
def test_bad_arguments_name_the_key(kw, key):
    """Bad modes or thresholds are errors naming the config key."""
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=key):
        rollout_correction(x, x, torch.ones(1, 2), **kw)


# ------------------------------------------------------------------ invariants


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(1.01, 4.0), st.floats(1.0, 3.0), st.sampled_from(RS_MODES[1:]))
def test_invariants(seed, hi, widen, rs_mode):
    """0 <= w <= C; keep is a subset of mask; widening [lo, hi] never rejects more; for
    one-token sequences token-, sequence- and geometric-level decisions coincide."""
    old, behav, mask = _random_batch(seed, spread=1.0)
    for is_mode in ("token", "sequence"):
        w, keep, _ = rollout_correction(
            old, behav, mask, is_mode=is_mode, is_threshold=hi, rs_mode=rs_mode, rs_threshold=hi
        )
        assert (w >= 0).all() and (w <= hi * (1 + 1e-12)).all() and (keep <= mask).all()
    _, wide, _ = rollout_correction(
        old, behav, mask, rs_mode=rs_mode, rs_threshold=hi * widen, rs_threshold_lower=1 / (hi * widen)
    )
    assert (wide >= keep).all()
    one = (old[:, :1], behav[:, :1], torch.ones_like(old[:, :1]))
    outs = [
        rollout_correction(*one, is_mode=i, is_threshold=hi, rs_mode=r, rs_threshold=hi)[:2]
        for i, r in (("token", "token"), ("sequence", "sequence"), ("sequence", "geometric"))
    ]
    for w, k in outs[1:]:
        assert torch.allclose(w, outs[0][0], rtol=1e-12) and torch.equal(k, outs[0][1])
