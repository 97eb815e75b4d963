"""GRPO advantages: the tensor and the ragged version against a loop reference, plus invariants."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.algo import group_advantages, grpo_advantages
from tests.algo.algo_reference import ref_group_adv


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (4, 2), (7, 8)])
def test_grpo_matches_reference(norm, shape):
    """grpo_advantages == per-group loop (population std + eps) on random rewards."""
    g = torch.Generator().manual_seed(10 * shape[0] + shape[1] + norm)
    rewards = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 1
    fast = grpo_advantages(rewards, norm_by_std=norm, eps=1e-6)
    ref = [ref_group_adv(row, norm, 1e-6) for row in rewards.tolist()]
    assert fast.shape == rewards.shape
    assert torch.allclose(fast, torch.tensor(ref, dtype=torch.float64), atol=1e-9)


def test_grpo_identical_rewards_give_zero_not_nan():
    """A group with identical rewards (or one member) gets advantage exactly 0, never 0/0."""
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert torch.equal(grpo_advantages(rewards), torch.zeros_like(rewards))
    assert torch.equal(grpo_advantages(torch.tensor([[5.0]])), torch.zeros(1, 1))


def test_grpo_rejects_wrong_rank():
    """rewards must be [G, N]; a flat vector is an error, not a silent single group."""
    with pytest.raises(ValueError, match=r"\[G, N\]"):
        grpo_advantages(torch.ones(4))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.floats(-100, 100, allow_nan=False), min_size=0, max_size=9), min_size=0, max_size=6),
    st.booleans(),
)
def test_ragged_groups_match_reference(groups, norm):
    """group_advantages handles ragged groups, each normalised by itself only."""
    out = group_advantages(groups, norm_by_std=norm)
    assert [len(g) for g in out] == [len(g) for g in groups]
    for got, g in zip(out, groups):
        assert got == pytest.approx(ref_group_adv(g, norm, 1e-6), abs=1e-6) if g else got == []


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8),
    st.floats(-50, 50),
    st.floats(0.5, 20),
)
def test_shift_and_scale_invariance(rewards, shift, scale):
    """Centring removes any constant shift; std-normalisation removes any positive scale."""
    base = group_advantages([rewards])[0]
    moved = group_advantages([[scale * r + shift for r in rewards]])[0]
    sigma = statistics.pstdev(rewards)
    if sigma > 1e-3:  # eps matters only for near-constant groups
        # a = c / (sigma + eps) vs c / (sigma + eps / scale): they differ by at most |a| * eps * |1 - 1 / scale| / sigma
        tol = 2 * max(abs(a) for a in base) * 1e-6 * max(1.0, 1 / scale) / sigma + 1e-9
        assert moved == pytest.approx(base, abs=tol)
    assert sum(group_advantages([rewards], norm_by_std=False)[0]) == pytest.approx(0.0, abs=1e-9)


def test_tensor_and_ragged_agree():
    """The two entry points give the same numbers for rectangular input."""
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.2, 0.4, 0.9, 0.1]], dtype=torch.float64)
    for norm in (True, False):
        ragged = torch.tensor(group_advantages(rewards.tolist(), norm), dtype=torch.float64)
        assert torch.allclose(grpo_advantages(rewards, norm), ragged, atol=1e-12)
