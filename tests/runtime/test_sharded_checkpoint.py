"""``trainer.checkpoint_in_background`` at 2 ranks (issue #22, item 5): the ranks write their DCP files when the
checkpoint is taken, between two steps, in the caller's thread (no collective in the writer thread while the next
step runs); the writer thread moves them into ``checkpoint/ranks`` and writes ``trainer.pt``; the checkpoint holds
the state of when it was taken, not of the step that ran meanwhile."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from psrl.config import load_config
from psrl.models import build_policy
from psrl.runtime.checkpoint import CheckpointSaver
from psrl.tasks import get_task
from psrl.train import Trainer
from tests.runtime.test_train_sharded import _batch


@pytest.mark.slow
def test_a_background_checkpoint_at_two_ranks_runs_its_collective_between_steps(tmp_path, monkeypatch):
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "task.name=arith"])
    policy = build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)
    run_dir = tmp_path / "run"
    calls: list[tuple[str, str]] = []
    real_call = Trainer._call

    def call(self: Trainer, cmd: str, arg: Any = None) -> list[Any]:
        calls.append((cmd, threading.current_thread().name))
        return real_call(self, cmd, arg)

    real_save = Trainer.save

    def save(self: Trainer, directory: str | Path, state: dict | None = None) -> Path:
        calls.append(("write", threading.current_thread().name))
        return real_save(self, directory, state)

    monkeypatch.setattr(Trainer, "_call", call)
    monkeypatch.setattr(Trainer, "save", save)
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer, 2, run_dir)
    state = {"version": 1, "staleness": {}, "agents": {}}
    coord = SimpleNamespace(
        trainer=trainer, manager=None, cfg=cfg, version=1, state_dict=lambda: state
    )  # what CheckpointSaver reads of a coordinator
    saver = CheckpointSaver(background=True)
    try:
        trainer.step(_batch(policy, 0))
        trainer.publish(1)
        want = trainer.latest_policy().export_state()
        saver.save(run_dir, coord, None)  # taken now; written by the writer thread
        trainer.step(_batch(policy, 1))  # training goes on meanwhile
        trainer.publish(2)
        saver.close()
    finally:
        trainer.close()
    assert [t for cmd, t in calls if cmd == "save"] == [threading.main_thread().name]  # the ranks' collective
    assert [t.startswith("psrl-checkpoint") for cmd, t in calls if cmd == "write"] == [True]  # the rest
    ckpt = run_dir / "checkpoint"
    assert (ckpt / "ranks" / ".metadata").exists() and not (run_dir / "checkpoint.ranks.tmp").exists()
    dcp_to_torch_save(str(ckpt / "ranks"), str(tmp_path / "ranks.pt"))
    ranks = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert all(torch.equal(ranks["model"][k], v) for k, v in want.items())  # of step 1, not step 2
    assert not all(torch.equal(trainer.latest_policy().export_state()[k], v) for k, v in want.items())
    resumed = Trainer(build_policy(cfg.model, get_task(cfg.task, seed=0), seed=1), cfg.algorithm, cfg.trainer)
    assert resumed.load(Path(ckpt)) == 1
    got = resumed.policy.export_state()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert resumed.start().worker.optimizer.state  # type: ignore[attr-defined]
