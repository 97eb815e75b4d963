"""Trainer faults: a NaN / infinite loss or gradient skips the step and leaves the weights as they were;
``trainer.max_skipped_steps`` skips in a row stop ``psrl train`` with a checkpoint and one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import psrl.train.worker as worker_mod
from psrl.config import AlgorithmConfig, TrainerConfig
from psrl.rollout.fakes import random_batch
from psrl.runtime.recorder import read_jsonl
from psrl.train import Trainer
from tests.train.test_train_trainer import _setup


def _weights(policy):
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _nan_loss_at(monkeypatch, calls: set):
    """The rank's per-token loss is NaN on the chosen calls (0-based; one micro-batch, so one call, per minibatch)."""
    real = worker_mod.token_loss
    n = [0]

    def loss(*args, **kw):
        out, m = real(*args, **kw)
        k, n[0] = n[0], n[0] + 1
        return (out * float("nan") if k in calls else out), m

    monkeypatch.setattr(worker_mod, "token_loss", loss)


def _optimizer(tr: Trainer) -> torch.optim.Optimizer:
    """The AdamW of a world-size-1 trainer's in-process rank."""
    return tr.start().worker.optimizer  # type: ignore[attr-defined]


@pytest.mark.parametrize("minibatches, bad_call", [(1, 0), (3, 0), (3, 2)])
def test_nan_loss_skips_the_step_and_keeps_the_weights(monkeypatch, minibatches, bad_call):
    """A NaN loss in any minibatch: no update survives (a later minibatch's NaN rolls back the earlier ones),
    ``last_skip`` names it, the skip is counted; the next finite step trains and resets the run of skips."""
    task, policy = _setup()
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(minibatches=minibatches))
    before = _weights(policy)
    _nan_loss_at(monkeypatch, {bad_call})
    m = tr.step(random_batch(task, version=0))
    assert _same(before, _weights(policy))
    assert "loss is nan" in tr.last_skip and (minibatches == 1 or f"minibatch {bad_call + 1}/3" in tr.last_skip)
    assert m["train/skipped_steps"] == 1 and tr.skipped_in_a_row == 1 and "train/loss" not in m
    m = tr.step(random_batch(task, version=1, seed=1))
    assert tr.last_skip is None and tr.skipped_in_a_row == 0 and m["train/skipped_steps"] == 1
    assert not _same(before, _weights(policy)) and tr.version == 0  # the version is the coordinator's to move


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_step(bad):
    """A gradient with a NaN / inf entry (finite loss): clip_grad_norm_ reports it, no optimiser step is taken."""
    task, policy = _setup()
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig())
    before = _weights(policy)
    first = next(policy.model.parameters())
    handle = first.register_hook(lambda g: torch.full_like(g, bad))
    tr.step(random_batch(task))
    handle.remove()
    assert tr.last_skip == "gradient norm is not finite" and tr.skipped_steps == 1
    assert _same(before, _weights(policy))
    assert not any(s for s in _optimizer(tr).state.values())  # AdamW's moments never saw the bad gradient


def test_skip_counters_survive_a_checkpoint_and_optimizer_state_is_optional(tmp_path):
    """save/load keep the skip counters; trainer.save_optimizer=false writes no AdamW state and a load of
    such a checkpoint keeps a fresh optimiser."""
    task, policy = _setup()
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(save_optimizer=False))
    tr.step(random_batch(task))
    policy.version = 1  # what the coordinator does after a step
    tr.skipped_steps, tr.skipped_in_a_row = 4, 2
    tr.save(tmp_path)
    saved = dcp.FileSystemReader(str(tmp_path / "ranks")).read_metadata().state_dict_metadata
    assert saved and not any(k.startswith("optim.") for k in saved)
    assert "model" not in torch.load(tmp_path / "trainer.pt", weights_only=False)  # the weights are DCP's alone
    _, policy2 = _setup(seed=1)
    tr2 = Trainer(policy2, AlgorithmConfig(), TrainerConfig())
    assert tr2.load(tmp_path) == 1 and (tr2.skipped_steps, tr2.skipped_in_a_row) == (4, 2)
    assert not _optimizer(tr2).state
    assert _same(_weights(policy), _weights(policy2))


def test_psrl_train_stops_after_max_skipped_steps_with_a_checkpoint_and_one_line(tmp_path, monkeypatch, capsys):
    """Real ``psrl train`` (tiny model): every loss from step 2 on is NaN. Steps 2 and 3 are skipped (their
    trajectories recorded 'skipped' with the reason, train/skipped_steps counts them), and with
    trainer.max_skipped_steps=2 the run stops after step 3 with a one-line message and a checkpoint at step 3."""
    from psrl.runtime.checkpoint import load_checkpoint
    from psrl.train_cli import main
    from tests.runtime.test_train_cli_e2e import TINY

    real = worker_mod.token_loss

    def loss(logp, *args, **kw):
        out, m = real(logp, *args, **kw)
        return (out * float("nan") if Trainer.version_now >= 1 else out), m

    real_step = Trainer.step

    def step(self, batch):
        Trainer.version_now = int(batch.version)
        return real_step(self, batch)

    monkeypatch.setattr(worker_mod, "token_loss", loss)
    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Trainer, "version_now", 0, raising=False)
    run_dir = tmp_path / "run"
    rc = main(
        TINY
        + [
            f"trainer.run_dir={run_dir}",
            "trainer.total_steps=6",
            "trainer.max_skipped_steps=2",
            "trainer.checkpoint_every=0",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "2 steps in a row skipped" in err and "loss is nan" in err and "trainer.lr" in err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 2]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    skipped = [t for t in trajs if t["status"] == "skipped"]
    assert len(skipped) == 2 * 2 * 2 and all("loss is nan" in t["reason"] for t in skipped)
    assert rows[-1]["counts/skipped"] == len(skipped) and rows[-1]["counts/trained"] == 2 * 2
    assert load_checkpoint(run_dir)["version"] == 3
