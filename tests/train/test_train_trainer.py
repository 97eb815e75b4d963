"""ParameterStore versioning and the Trainer step (vs a slow per-trajectory reference), reproducibility, checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

from psrl.algo.losses import policy_loss
from psrl.config import AlgorithmConfig, ModelConfig, TaskConfig, TrainerConfig
from psrl.models import build_policy
from psrl.rollout.fakes import random_batch
from psrl.tasks import get_task
from psrl.train import Trainer
from psrl.weights import ParameterStore


def test_store_keeps_last_k_and_rejects_old_versions():
    """publish strictly increasing versions; only the newest `keep` are held; get() is the newest."""
    store = ParameterStore(keep=2)
    assert store.latest_version() is None
    for v in range(4):
        store.publish(v, {"w": torch.tensor([float(v)])})
    assert store.versions() == [2, 3] and store.get()[0] == 3 and float(store.get(2)[1]["w"]) == 2.0
    with pytest.raises(KeyError):
        store.get(1)
    with pytest.raises(ValueError):
        store.publish(3, {})


def _setup(seed=0):
    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=seed)
    return task, policy


def test_step_loss_matches_a_slow_per_trajectory_reference():
    """The batched step's loss == policy_loss on tensors built one trajectory at a time with hand-written GRPO."""
    task, policy = _setup()
    batch = random_batch(task)
    trajs = [t for g in batch.groups for t in g]
    adv = []
    for g in batch.groups:
        r = [t.reward for t in g]
        mu = sum(r) / len(r)
        sd = (sum((x - mu) ** 2 for x in r) / len(r)) ** 0.5
        adv += [(x - mu) / (sd + 1e-6) for x in r]
    width = max(len(t.response_ids) for t in trajs)
    logp = torch.zeros(len(trajs), width)
    mask = torch.zeros(len(trajs), width)
    behav = torch.zeros(len(trajs), width)
    with torch.no_grad():
        for i, t in enumerate(trajs):
            row = policy.sequence_logprobs([t.prompt_ids], [t.response_ids])[0]
            logp[i, : len(row)] = row
            mask[i, : len(row)] = 1.0
            behav[i, : len(row)] = torch.tensor(t.logprobs)
    ref, _ = policy_loss(logp, logp, behav, torch.tensor(adv), mask, AlgorithmConfig())
    metrics = Trainer(policy, AlgorithmConfig(), TrainerConfig()).step(batch)
    assert metrics["train/loss"] == pytest.approx(float(ref), abs=1e-5)
    assert policy.version == 0  # versions are the coordinator's to set (and publish)
    assert metrics["train/adv_abs_mean"] == pytest.approx(sum(abs(a) for a in adv) / len(adv), rel=1e-5)


def test_minibatches_take_several_optimiser_steps():
    """With 3 minibatches later ones see a ratio != 1 (approx_kl > 0)."""
    task, policy = _setup()
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(minibatches=3, lr=0.01))
    m = tr.step(random_batch(task, version=4))
    assert m["actor/approx_kl"] > 0


def test_same_seed_same_weights_and_checkpoint_resume(tmp_path):
    """Two trainers with the same seed end with identical weights; save/load then continue == uninterrupted."""

    def run(resume_dir=None):
        task, policy = _setup()
        tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=0.01))
        tr.step(random_batch(task, 0, seed=1))
        policy.version = 1  # what the coordinator does after a step
        if resume_dir is not None:
            tr.save(resume_dir)
            task, policy = _setup(seed=5)
            tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=0.01))
            assert tr.load(resume_dir) == 1
        tr.step(random_batch(task, 1, seed=2))
        return policy.export_state()

    a, b, c = run(), run(), run(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.allclose(a[k], c[k], atol=1e-7) for k in a)


def test_a_checkpoint_of_the_earlier_one_process_layout_loads_and_continues(tmp_path):
    """``trainer.pt`` as the one-process trainer wrote it before issue #33 (weights and AdamW inside, no ``ranks/``):
    the one Trainer loads it -- weights, version, AdamW moments -- and the next step equals the reference trainer's
    continuing from the same state."""
    from psrl.train.steps import rng_state
    from tests.train.reference_trainer import ReferenceTrainer

    task, policy = _setup()
    ref = ReferenceTrainer(policy, AlgorithmConfig(), TrainerConfig(lr=0.01))
    ref.step(random_batch(task, 0, seed=1))
    policy.version = 1
    old = {
        "model": policy.export_state(),
        "version": 1,
        **rng_state(ref.rng, policy.generator),
        "skipped": (0, 0),
        "optimizer": ref.optimizer.state_dict(),
    }
    torch.save(old, tmp_path / "trainer.pt")
    _, fresh = _setup(seed=5)
    tr = Trainer(fresh, AlgorithmConfig(), TrainerConfig(lr=0.01), work_dir=tmp_path / "work")
    assert tr.load(tmp_path) == 1
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in policy.model.state_dict().items())
    assert tr.start().worker.optimizer.state  # type: ignore[attr-defined]  # AdamW's moments came across
    batch = random_batch(task, 1, seed=2)
    ref.step(batch)
    tr.step(batch)
    diff = max(float((fresh.model.state_dict()[k] - v).abs().max()) for k, v in policy.model.state_dict().items())
    assert diff < 1e-6


def test_warm_start_lowers_the_demo_loss():
    """Supervised warm start on scripted demos reduces the masked cross-entropy."""
    task, policy = _setup()
    losses = Trainer(policy, AlgorithmConfig(), TrainerConfig()).warm_start(
        task.demonstrations(128, random.Random(0)), 30
    )
    assert len(losses) == 30 and losses[-1] < losses[0] * 0.8


class _TwoAnsweringRanks:
    """Two ranks that answer without a model (a launcher for :class:`Trainer`): rank 0 every row's log-probs, then a
    step's metrics; what the driver does around them is the test's subject."""

    world_size = 2

    def __init__(self, spec, world_size, reply_timeout_s, log_dir):
        assert world_size == 2

    def call(self, cmd, arg=None):
        if cmd == "logprobs":
            return [{i: [-1.0] * len(r) for i, r in enumerate(arg.responses)}, {}]
        assert cmd == "train_step", cmd
        zero = {"train/loss": 0.0, "train/grad_norm": 0.0, "train/empty_minibatches": 0.0}
        return [{**zero, "skipped_minibatch": 0.0, "skip_reason": ""}] * 2

    def close(self):
        pass


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_driver_gives_back_its_freed_heap_after_each_step_at_world_size_2(monkeypatch, tmp_path, world_size):
    """At world size > 1 the driver trims its own heap after each step (each rank trims its own: psrl/heap.py); at
    world size 1 the in-process rank's trim is the driver's, so the driver adds none."""
    from psrl.train import trainer as trainer_module

    trims = []
    monkeypatch.setattr(trainer_module, "release_freed", lambda: trims.append(1) or True)
    task, policy = _setup()
    tr = Trainer(policy, AlgorithmConfig(), TrainerConfig(), world_size, tmp_path, launcher=_TwoAnsweringRanks)
    for step in range(3):
        tr.step(random_batch(task, step, seed=step))
    assert len(trims) == (3 if world_size == 2 else 0)
