"""The planner of the sharded trainer: every trajectory once, equal micro-batch counts, budgets kept, and loss
weights whose weighted sum is the single-process aggregate for every mode (global denominators)."""

from __future__ import annotations

import random

import pytest
import torch

from psrl.algo.losses import AGG_MODES, aggregate
from psrl.train.planner import balance, loss_weights, pack, plan


def _area(lengths: list[int] | dict[int, int], rows) -> int:
    """What a right-padded micro-batch allocates: rows x its longest row."""
    return len(rows) * max((lengths[i] for i in rows), default=0)


def _skewed(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([3, 5, 8, 40, 120]) for _ in range(n)]


@pytest.mark.parametrize("world,minibatches,budget", [(1, 1, None), (2, 1, 64), (2, 3, 256), (3, 2, 16), (4, 1, None)])
def test_plan_covers_every_trajectory_once_with_equal_depth(world, minibatches, budget):
    lengths = _skewed(13)
    p = plan(lengths, world, minibatches, budget)
    seen = sorted(i for mb in p.minibatches for per_rank in mb for m in per_rank for i in m.rows)
    assert seen == list(range(len(lengths)))
    for mb in p.minibatches:
        assert len(mb) == world
        assert len({len(per_rank) for per_rank in mb}) == 1  # no rank runs one collective fewer
        for per_rank in mb:
            for m in per_rank:
                assert budget is None or len(m.rows) == 1 or _area(lengths, m.rows) <= budget
    # the minibatches are the single-process trainer's contiguous chunks
    chunks = [c.tolist() for c in torch.arange(len(lengths)).tensor_split(minibatches)]
    assert [p.rows(k) for k in range(len(p.minibatches))] == chunks


def test_more_ranks_than_trajectories_pads_with_zero_weight_micro_batches():
    p = plan([7], 3, 1, None)
    depths = [len(r) for r in p.minibatches[0]]
    assert depths == [1, 1, 1]
    assert sum(m.padding for r in p.minibatches[0] for m in r) == 2


def test_balance_by_tokens_and_pack_under_budget():
    shares = balance({0: 100, 1: 10, 2: 10, 3: 90}, 2)
    assert sorted(sum({0: 100, 1: 10, 2: 10, 3: 90}[i] for i in s) for s in shares) == [100, 110]
    assert pack({0: 30, 1: 30, 2: 40, 3: 70}, 70) == [[3], [2], [0, 1]]  # [0, 2] would pad to 2 x 40 = 80
    assert pack({0: 5, 1: 6}, None) == [[0, 1]]


@pytest.mark.parametrize("world", [1, 2])
def test_budget_bounds_the_padded_area_of_one_long_row_among_many_short(world):
    """The budget is on rows x longest row, what a right-padded forward allocates: one 900-token row beside
    many 10-token rows under a 1,000 budget counted in tokens would be one micro-batch padded to ~10x the budget
    (a GPU out-of-memory); here the long row runs nearly alone, the short ones 100 to a micro-batch; a row over
    the budget is alone; every rank still runs as many micro-batches as the others."""
    budget = 1000
    lengths = [900] + [10] * 99 + [1500]
    p = plan(lengths, world, 1, budget)
    depth = {len(per_rank) for per_rank in p.minibatches[0]}
    assert len(depth) == 1
    for per_rank in p.minibatches[0]:
        for m in per_rank:
            if m.rows and max(lengths[i] for i in m.rows) > budget:
                assert len(m.rows) == 1
            elif m.rows:
                assert _area(lengths, m.rows) <= budget, (m.rows, _area(lengths, m.rows))
    alone = pack({0: 900, **{i: 10 for i in range(1, 100)}}, budget)
    assert alone[0] == [0] and all(_area({0: 900, **{i: 10 for i in range(1, 100)}}, b) <= budget for b in alone)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_weights_reproduce_the_aggregate_over_any_split(mode):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 1, 9, 30, 2, 12]
    width = max(lengths)
    loss = torch.randn(len(lengths), width, generator=g, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = (torch.rand(n, generator=g) > 0.2).double()
    mask[2] = 0.0  # a sequence with no valid token (all rejected) neither dilutes nor divides by 0
    p = plan(lengths, 2, 2, 16)
    for k in range(len(p.minibatches)):
        rows = p.rows(k)
        want = aggregate(loss[rows], mask[rows], mode)
        w = loss_weights({i: mask[i].tolist() for i in rows}, mode)
        got = sum(
            float((torch.tensor(w[i], dtype=torch.float64) * loss[i]).sum())
            for per_rank in p.minibatches[k]
            for m in per_rank
            for i in m.rows
        )
        assert got == pytest.approx(float(want), rel=1e-12, abs=1e-12)


def test_bad_mode_names_the_key():
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode"):
        loss_weights({0: [1.0]}, "sum")
