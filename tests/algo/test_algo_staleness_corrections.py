"""The corrections for high staleness -- M2PO's second-moment masking and VCPO's ESS-scaled learning rate --
against slow references written as plain loops, on random inputs; their keys off by default and checked at load."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.algo.corrections import batch_corrections, ess_lr_scale, m2po_keep, sequence_ess
from psrl.algo.divergence import token_log_ratio
from psrl.cli import main as psrl
from psrl.config import RolloutCorrectionConfig


def ref_m2po_keep(ds: list[float], tau: float) -> list[bool]:
    """Mask the largest d^2 one at a time while the rest's second moment exceeds tau (ties: earliest first)."""
    order = sorted(range(len(ds)), key=lambda i: -ds[i] * ds[i])  # Python's sort is stable
    kept = [True] * len(ds)
    for i in order:
        rest = [ds[j] * ds[j] for j in range(len(ds)) if kept[j]]
        total = 0.0
        for v in rest:
            total += v
        if total <= tau * len(rest):
            break
        kept[i] = False
    return kept


def ref_sequence_ess(rows: list[list[float]]) -> float:
    """ESS of the weights exp(sum of a row's log-ratios), rows without tokens left out, in 60-digit decimals."""
    with localcontext() as ctx:
        ctx.prec = 60
        w = [Decimal(sum(r)).exp() for r in rows if r]
        return float(sum(w) ** 2 / (len(w) * sum(x * x for x in w))) if w else 1.0


def _flat_valid(d: torch.Tensor, valid: torch.Tensor) -> list[float]:
    return [x for row, v in zip(d.tolist(), valid.tolist()) for x, ok in zip(row, v) if ok]


@st.composite
def dyadic_batches(draw):
    """``(d, valid)`` with log-ratios on a 1/16 grid: squares and their sums are exact in float64, so the mask is
    compared exactly, boundary ties (sum == tau * count) included."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    d = torch.tensor([[draw(st.integers(-24, 24)) / 16 for _ in range(t)] for _ in range(b)], dtype=torch.float64)
    valid = torch.tensor([[draw(st.booleans()) for _ in range(t)] for _ in range(b)])
    return torch.where(valid, d, torch.zeros_like(d)), valid


@settings(max_examples=200, deadline=None)
@given(dyadic_batches(), st.integers(1, 40).map(lambda k: k / 64))
def test_m2po_mask_equals_the_slow_reference(batch, tau):
    d, valid = batch
    kept = m2po_keep(d, valid, tau)
    assert not (kept & ~valid).any()
    assert _flat_valid(kept, valid) == ref_m2po_keep(_flat_valid(d, valid), tau)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5.0, 5.0, allow_nan=False), min_size=1, max_size=30), st.floats(1e-3, 1.0))
def test_m2po_keeps_the_smallest_and_masks_as_few_as_it_can(ds, tau):
    """Any floats: the kept tokens' second moment is <= tau, every masked d^2 >= every kept d^2, and keeping one
    more (the smallest masked) would break the bound -- so only the extreme tokens go."""
    d = torch.tensor([ds], dtype=torch.float64)
    kept = m2po_keep(d, torch.ones_like(d, dtype=torch.bool), tau)[0].tolist()
    sq = [x * x for x in ds]
    keep_sq = [s for s, k in zip(sq, kept) if k]
    drop_sq = [s for s, k in zip(sq, kept) if not k]
    assert sum(keep_sq) <= tau * len(keep_sq) * (1 + 1e-9) + 1e-12
    if keep_sq and drop_sq:
        assert min(drop_sq) >= max(keep_sq)
    if drop_sq:
        assert sum(keep_sq) + min(drop_sq) > tau * (len(keep_sq) + 1) * (1 - 1e-9)


def test_m2po_masks_nothing_near_policy_and_refuses_a_bad_tau():
    d = torch.tensor([[0.1, -0.15, 0.05]], dtype=torch.float64)
    valid = torch.ones_like(d, dtype=torch.bool)
    assert m2po_keep(d, valid, 0.04).all()
    with pytest.raises(ValueError, match="algorithm.rollout_correction.m2po_threshold"):
        m2po_keep(d, valid, 0.0)


@st.composite
def logprob_batches(draw):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    logp = st.floats(-15.0, 0.0, allow_nan=False)
    old = [[draw(logp) for _ in range(t)] for _ in range(b)]
    behav = [[draw(logp) for _ in range(t)] for _ in range(b)]
    mask = [[float(draw(st.booleans())) for _ in range(t)] for _ in range(b)]
    return old, behav, mask


@settings(max_examples=150, deadline=None)
@given(logprob_batches(), st.floats(0.01, 1.0))
def test_ess_lr_scale_equals_the_slow_reference(batch, floor):
    """scale = max(floor, sqrt(min(1, ESS))) of the sequence weights exp(sum_t (old - behav)), within 1e-6."""
    old, behav, mask = batch
    rows = [[o - b for o, b, m in zip(ro, rb, rm) if m] for ro, rb, rm in zip(old, behav, mask)]
    ref_ess = ref_sequence_ess(rows)
    ref_scale = max(floor, math.sqrt(min(1.0, ref_ess)))
    d, valid = token_log_ratio(*(torch.tensor(x, dtype=torch.float64) for x in batch))
    assert sequence_ess(d, valid) == pytest.approx(ref_ess, rel=1e-6, abs=1e-6)
    assert ess_lr_scale(sequence_ess(d, valid), floor) == pytest.approx(ref_scale, rel=1e-6, abs=1e-6)


def test_ess_lr_scale_bounds():
    """On-policy: scale 1; one sequence holding the weight of N: sqrt(1/N), unless the floor is higher."""
    d = torch.zeros(4, 3, dtype=torch.float64)
    valid = torch.ones_like(d, dtype=torch.bool)
    assert ess_lr_scale(sequence_ess(d, valid), 0.1) == 1.0
    d[0] = 15.0
    assert ess_lr_scale(sequence_ess(d, valid), 0.1) == pytest.approx(0.5, rel=1e-9)
    assert ess_lr_scale(sequence_ess(d, valid), 0.8) == 0.8
    with pytest.raises(ValueError, match="algorithm.rollout_correction.ess_lr_min"):
        ess_lr_scale(1.0, 0.0)


def test_batch_corrections_are_off_by_default_and_report_only_when_on():
    """Defaults: no mask, scale 1, no metric (a step's row is unchanged); on: the mask, the scale and their metric."""
    g = torch.Generator().manual_seed(0)
    behav = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    old = behav + torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.ones_like(old)
    assert batch_corrections(old, behav, mask, RolloutCorrectionConfig()) == (None, 1.0, {})
    rc = SimpleNamespace(m2po=True, m2po_threshold=0.04, ess_lr=True, ess_lr_min=0.1)
    keep, scale, metrics = batch_corrections(old, behav, mask, rc)
    assert keep.dtype == mask.dtype and 0 < metrics["correction/m2po_masked_frac"] < 1
    assert metrics["correction/m2po_masked_frac"] == pytest.approx(1 - float(keep.mean()))
    assert scale == metrics["correction/ess_lr_scale"] and 0.1 <= scale < 1


@pytest.mark.parametrize(
    "override, says",
    [
        ("algorithm.rollout_correction.m2po_threshold=0", "must be > 0"),
        ("algorithm.rollout_correction.ess_lr_min=1.5", "must be in (0, 1]"),
        ("algorithm.rollout_correction.ess_lr_min=0", "must be in (0, 1]"),
        ("algorithm.rollout_correction.m2po=maybe", "true/false"),
        ("algorithm.rollout_correction.ess_lr=2", "true/false"),
    ],
)
def test_a_wrong_value_is_one_line_naming_the_key(override, says, tmp_path, monkeypatch, capsys):
    """Through the real command line: exit 2, one line that names the key and says what it accepts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PSRL_DEBUG", "0")
    assert psrl(["train", override]) == 2
    err = capsys.readouterr().err.strip()
    key = override.split("=")[0]
    assert "\n" not in err and err.startswith(f"psrl train: config key '{key}'") and says in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written
