"""Steps of the 2-rank trainer beyond equivalence (issue #22's acceptance): the micro-batch token budget does not
change the update, ranks with very different token counts finish; a step skipped in a later minibatch leaves no
update (as :class:`psrl.train.Trainer` does); save at step k and continue on new ranks = the uninterrupted run.

The session's two ranks (``two_ranks``, tests/train/conftest.py) are shared: every test loads the state it starts
from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from psrl.train.launch import InProcess, LocalRanks
from psrl.train.planner import plan
from psrl.train.worker import StepInput, step_input
from tests.train.test_train_worker import WAIT_S, _max_diff, _spec, _state, _step

SKEWED = [62, 3, 2, 40, 30, 45, 30, 3]
"""Tokens (prompt 2 + response) per trajectory, in 3 minibatches: [62, 3, 2] puts 62 tokens on one rank and 5 on
the other; [40, 30, 45] is one micro-batch a rank under 256 tokens, two beside one (and a padding one) under 64."""


def _skewed_step(
    ranks, world: int, budget: int | None, nan_minibatch: int | None = None, masked: tuple[int, ...] = ()
) -> dict[str, float]:
    """One step on the SKEWED batch (3 minibatches); ``nan_minibatch``: that minibatch's advantages are NaN;
    ``masked``: those minibatches' loss masks are all zero."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 40, (2,), generator=g).tolist() for _ in SKEWED]
    responses = [torch.randint(1, 40, (n - 2,), generator=g).tolist() for n in SKEWED]
    masks = [[1.0] * (n - 2) for n in SKEWED]
    adv = torch.randn(len(SKEWED), generator=g).tolist()
    p = plan(SKEWED, world, 3, budget)
    if nan_minibatch is not None:
        for i in p.rows(nan_minibatch):
            adv[i] = float("nan")
    for k in masked:
        for i in p.rows(k):
            masks[i] = [0.0] * len(masks[i])
    old: dict[int, list[float]] = {}
    for part in ranks.call("logprobs", StepInput(p, prompts, responses)):
        old.update(part)
    behav = [[o - 0.05 for o in old[i]] for i in range(len(SKEWED))]
    inp = step_input(p, prompts, responses, old, behav, adv, masks, _spec("token-mean").algo)
    return ranks.call("train_step", inp)[0]


def test_the_token_budget_does_not_change_the_update_and_skewed_ranks_finish(two_ranks, tmp_path):
    """Token budgets 64, 256 and unlimited at 2 ranks (from the same saved state: the session's ranks, AdamW state
    and all) give the update of the in-process worker within 1e-5; the 62-vs-5-token minibatch and the padded one
    finish (a rank running one forward fewer would hang here until the reply timeout)."""
    start = str(tmp_path / "start")
    two_ranks.call("save", start)
    one = InProcess(_spec("token-mean"))
    one.call("load", start)
    before = _state(one)
    _skewed_step(one, 1, None)
    want = _state(one)
    depth = {b: len(plan(SKEWED, 2, 3, b).minibatches[1][0]) for b in (64, 256, None)}
    assert depth == {64: 2, 256: 1, None: 1}  # the budget does change the micro-batches
    tokens = sorted(sum(SKEWED[i] for m in r for i in m.rows) for r in plan(SKEWED, 2, 3, None).minibatches[0])
    assert tokens == [5, 62]
    diffs = {}
    for budget in (64, 256, None):
        two_ranks.call("load", start)
        _skewed_step(two_ranks, 2, budget)
        diffs[budget] = _max_diff(want, _state(two_ranks))
    print(f"max |param difference| from the in-process update by budget: {diffs}")
    assert _max_diff(before, want) > 1e-4  # the step moved the weights
    assert all(d <= 1e-5 for d in diffs.values()), diffs


def _saved(ranks, directory: Path) -> dict[str, torch.Tensor]:
    """What ``save`` writes (model and AdamW state), read back as full tensors keyed by their path."""
    ranks.call("save", str(directory))
    dcp_to_torch_save(str(directory), str(directory) + ".pt")
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, list):
            for j, v in enumerate(value):
                walk(f"{prefix}/{j}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value.float()
        else:
            flat[prefix] = torch.tensor(float(value)) if isinstance(value, (int, float)) else torch.tensor(0.0)

    walk("", torch.load(str(directory) + ".pt", weights_only=False))
    return flat


def test_a_nan_in_the_second_minibatch_leaves_no_update_at_two_ranks(two_ranks, tmp_path):
    """As in-process (tests/train/test_trainer_faults.py): the first minibatch stepped, the second's loss is NaN,
    so the step is skipped and the ranks' weights and AdamW state are those before the batch, bit for bit; the
    third minibatch never runs; the next step trains."""
    one = InProcess(_spec("token-mean"))
    _step(one, "token-mean", 1, 0, None)  # AdamW has state to restore
    one.call("save", str(tmp_path / "start"))
    two_ranks.call("load", str(tmp_path / "start"))
    before = _saved(two_ranks, tmp_path / "before")
    assert any(k.startswith("/optim/state") for k in before)
    m = _skewed_step(two_ranks, 2, 64, nan_minibatch=1)
    assert m["skipped_minibatch"] == 2.0
    after = _saved(two_ranks, tmp_path / "after")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _skewed_step(two_ranks, 2, 64)["skipped_minibatch"] == 0.0
    assert _max_diff(_state(one), _state(two_ranks)) > 1e-4


def test_an_all_masked_minibatch_does_not_step_adamw(two_ranks, tmp_path):
    """A minibatch with no token in the loss (all masked: the loss mask here; M2PO's and RS's keep masks reach the
    ranks the same way, through the driver's weights) is not stepped: a step of AdamW on its zero gradient would
    still move the weights (momentum; weight decay). Every minibatch masked: weights and AdamW state bit-identical
    at 2 ranks, counted in ``train/empty_minibatches``; one of three masked: two steps, not three (and both ranks
    agree: a rank stepping alone would deadlock here)."""
    one = InProcess(_spec("token-mean"))
    _step(one, "token-mean", 1, 0, None)  # AdamW has moments: a zero-gradient step would move the weights
    one.call("save", str(tmp_path / "start"))
    two_ranks.call("load", str(tmp_path / "start"))
    before = _saved(two_ranks, tmp_path / "before")
    m = _skewed_step(two_ranks, 2, 64, masked=(0, 1, 2))
    after = _saved(two_ranks, tmp_path / "after")
    assert before.keys() == after.keys() and any(k.startswith("/optim/state") for k in before)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert m["train/empty_minibatches"] == 3.0 and m["skipped_minibatch"] == 0.0
    m = _skewed_step(two_ranks, 2, 64, masked=(1,))
    assert m["train/empty_minibatches"] == 1.0
    stepped = _saved(two_ranks, tmp_path / "stepped")
    steps = {float(stepped[k] - before[k]) for k in before if k.startswith("/optim/state") and k.endswith("/step")}
    assert steps == {2.0}


@pytest.mark.slow
def test_save_at_step_k_and_continue_on_new_ranks_equals_the_uninterrupted_run(two_ranks, tmp_path):
    """2 ranks: 2 steps, save, 2 more steps (uninterrupted); new ranks load the save and run the same 2 steps:
    weights and AdamW state (moments and step counts) equal within 1e-6."""
    InProcess(_spec("token-mean")).call("save", str(tmp_path / "start"))
    two_ranks.call("load", str(tmp_path / "start"))
    for step in (0, 1):
        _step(two_ranks, "token-mean", 2, step, 16)
    two_ranks.call("save", str(tmp_path / "k"))
    for step in (0, 1):
        _step(two_ranks, "token-mean", 2, step, 8)
    want = _saved(two_ranks, tmp_path / "uninterrupted")
    with LocalRanks(_spec("token-mean"), 2, reply_timeout_s=WAIT_S, log_dir=tmp_path / "logs") as fresh:
        fresh.call("load", str(tmp_path / "k"))
        for step in (0, 1):
            _step(fresh, "token-mean", 2, step, 8)
        got = _saved(fresh, tmp_path / "resumed")
    assert want.keys() == got.keys() and any(k.startswith("/optim/state") for k in want)
    diff = max(float((want[k] - got[k]).abs().max()) for k in want)
    print(f"resume at 2 ranks: max |difference| of weights and AdamW state = {diff:.2e}")
    assert diff <= 1e-6
