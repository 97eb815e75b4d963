"""Checkpoint faults (issue #14): the last trainer.keep_checkpoints kept, a damaged newest one skipped for the
one before with a message, events.jsonl cut back to the checkpoint (no duplicate events, no half line), and a
save that fails on a full disk ends in one line with the previous checkpoint intact.

The real coordinator on fake engines and trainer, in virtual time; one test runs the real ``psrl train``."""

from __future__ import annotations

import errno
import json
from collections import Counter

import pytest

from psrl.errors import RunError
from psrl.rollout.fakes import FakeEngine, FakeTrainer
from psrl.runtime.checkpoint import CheckpointWriteError, resume, save_checkpoint
from psrl.runtime.coordinator import build_staleness_manager
from psrl.runtime.local import publish_first_version, wire
from psrl.runtime.recorder import EventLog, RunRecorder, read_jsonl
from psrl.runtime.vloop import run_virtual
from tests.rollout.harness import check_bound, config
from tests.runtime.test_coordinator_staleness import task


class SaveEvery:
    """on_step hook: flush the event log and checkpoint after every step in ``at`` (as psrl train does)."""

    def __init__(self, at, run_dir, recorder, coord, events=None):
        self.at, self.run_dir, self.recorder, self.coord, self.events = set(at), run_dir, recorder, coord, events

    def __call__(self, row):
        if self.events is not None:
            self.events.flush()
        if row["step"] in self.at:
            save_checkpoint(self.run_dir, self.coord, self.recorder)


def build(cfg, run_dir, log=None, events=False):
    """As psrl train wires it: the event log (if any) opened first, then the resume, which cuts it back."""
    rec = RunRecorder(run_dir)
    ev = EventLog(run_dir / "events.jsonl", clock=lambda: 0.0, flush_every=1 << 30) if events else None
    trainer = FakeTrainer(train_time=0.5)
    ck = resume(run_dir, trainer, rec, log=log, on_event=ev)
    manager = ck["manager"] if ck else build_staleness_manager(cfg, trainer.version, ev)
    engines = [FakeEngine(token_cost=0.01) for _ in range(cfg.psrl.deployment.n_rollout_instances)]
    coord = wire(cfg, task(), trainer, engines, publish_first_version(cfg, trainer), manager, sink=rec)
    if ck:
        coord.agents.load_state_dict(ck["agents"])
    return coord, rec, ck, ev


def run_to(coord, rec, ev, steps, save_at, run_dir):
    run_virtual(coord.run(steps, SaveEvery(save_at, run_dir, rec, coord, ev)))
    if ev is not None:
        ev.close()
    rec.close()


def no_duplicates(run_dir, steps, eta):
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert not [u for u, n in Counter(t["uid"] for t in trajs).items() if n > 1]
    assert check_bound(trajs, eta) == steps * 2 * 2


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_last_keep_checkpoints_are_kept(tmp_path, keep):
    """Checkpoint after each of 5 steps: checkpoint/ is version 5, checkpoint.v4 .. are the keep - 1 before it."""
    coord, rec, _, ev = build(config(trainer__keep_checkpoints=keep), tmp_path)
    run_to(coord, rec, ev, 5, range(1, 6), tmp_path)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint"))
    assert kept == sorted(["checkpoint"] + [f"checkpoint.v{v}" for v in range(4, 5 - keep, -1)])
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["version"] == 5 and set(manifest["files"]) == {"trainer.json", "coordinator.pkl"}


@pytest.mark.parametrize("damage", ["truncate", "garbage trainer", "delete state"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, damage):
    """Checkpoints at steps 2 and 4, the run dies at 5, the step-4 one is damaged: the resume says so, moves it
    aside, resumes from step 2 and trains on to 6 with every step and trajectory recorded once."""
    cfg = config(psrl__staleness=2)
    coord, rec, _, ev = build(cfg, tmp_path)
    run_to(coord, rec, ev, 5, {2, 4}, tmp_path)
    ck = tmp_path / "checkpoint"
    if damage == "truncate":
        data = (ck / "coordinator.pkl").read_bytes()
        (ck / "coordinator.pkl").write_bytes(data[: len(data) // 2])
    elif damage == "garbage trainer":
        (ck / "trainer.json").write_text('{"vers')
    else:
        (ck / "coordinator.pkl").unlink()
    said = []
    coord, rec, got, ev = build(cfg, tmp_path, log=said.append)
    assert got["dir"] == tmp_path / "checkpoint.v2" and coord.version == 2
    assert len(said) == 1 and str(ck) in said[0] and "resuming from" in said[0] and "checkpoint.v2" in said[0]
    assert (tmp_path / "checkpoint.damaged").is_dir() and not ck.exists()
    run_to(coord, rec, ev, 6, {6}, tmp_path)
    no_duplicates(tmp_path, 6, 2)


def test_every_checkpoint_damaged_is_one_line_naming_the_newest(tmp_path):
    coord, rec, _, ev = build(config(), tmp_path)
    run_to(coord, rec, ev, 3, {1, 3}, tmp_path)
    for name in ("checkpoint", "checkpoint.v1"):
        (tmp_path / name / "coordinator.pkl").write_bytes(b"junk")
    with pytest.raises(RunError) as e:
        build(config(), tmp_path)
    assert e.value.source == f"checkpoint {tmp_path / 'checkpoint'}" and "fix:" in str(e.value)


def test_events_jsonl_is_cut_back_to_the_checkpoint(tmp_path):
    """events.jsonl written past the checkpoint and ending in half a line (a SIGKILL mid-write): the resume cuts
    it to the checkpoint's length, so every line parses and no (kind, entry) event appears twice."""
    cfg = config(psrl__staleness=1)
    coord, rec, _, ev = build(cfg, tmp_path, events=True)
    run_to(coord, rec, ev, 5, {3}, tmp_path)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"t": 1.5, "kind": "occ')
    coord, rec, ck, ev = build(cfg, tmp_path, events=True)
    assert (tmp_path / "events.jsonl").stat().st_size == ck["offsets"]["events.jsonl"]
    run_to(coord, rec, ev, 7, {7}, tmp_path)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]  # no half line left
    dup = [k for k, n in Counter((e["kind"], str(e["entry"])) for e in events).items() if n > 1]
    assert not dup, dup[:5]
    assert sum(e["kind"] == "consume" for e in events) == 7 * 2
    no_duplicates(tmp_path, 7, 1)


def test_a_run_killed_before_its_first_checkpoint_starts_its_logs_over(tmp_path):
    """No checkpoint yet: the same command starts over, so the dead run's steps are not recorded twice."""
    coord, rec, _, ev = build(config(), tmp_path, events=True)
    run_to(coord, rec, ev, 2, set(), tmp_path)
    coord, rec, ck, ev = build(config(), tmp_path, events=True)
    assert ck is None and (tmp_path / "events.jsonl").stat().st_size == 0
    run_to(coord, rec, ev, 3, set(), tmp_path)
    no_duplicates(tmp_path, 3, 1)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The step-4 save hits ENOSPC: CheckpointWriteError (one line: what, the previous one is intact, the fix),
    no checkpoint.tmp left, checkpoint/ still the step-2 one, and a resume from it trains on without duplicates."""
    cfg = config()
    coord, rec, _, ev = build(cfg, tmp_path)
    real = FakeTrainer.save

    def save(self, directory, state=None):
        if self.version == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, directory, state)

    monkeypatch.setattr(FakeTrainer, "save", save)
    with pytest.raises(CheckpointWriteError) as e:
        run_to(coord, rec, ev, 6, {2, 4}, tmp_path)
    rec.close()
    msg = str(e.value)
    assert "\n" not in msg and "No space left" in msg and "previous checkpoint is intact" in msg and "fix:" in msg
    assert not (tmp_path / "checkpoint.tmp").exists()
    monkeypatch.setattr(FakeTrainer, "save", real)
    coord, rec, ck, ev = build(cfg, tmp_path)
    assert ck["dir"] == tmp_path / "checkpoint" and ck["version"] == 2
    run_to(coord, rec, ev, 6, {6}, tmp_path)
    no_duplicates(tmp_path, 6, 1)


CopyingTrainer = FakeTrainer
"""A fake trainer's ``state_dict`` is the state of when it was taken (as the real one's copy), so the saver writes
it in its thread."""


def test_a_background_checkpoint_holds_the_state_of_when_it_was_taken(tmp_path):
    """The saver captures between steps and writes in its thread: training that goes on meanwhile (the version
    moving) does not leak into it; a write that fails (full disk) is raised at the next save, previous intact."""
    from psrl.runtime.checkpoint import CheckpointSaver, load_checkpoint

    coord, rec, _, _ = build(config(), tmp_path)
    coord.trainer = trainer = CopyingTrainer(policy=coord.trainer.policy)
    saver = CheckpointSaver(background=True)
    saver.save(tmp_path, coord, rec)
    trainer.policy.version = 7  # "the next step" while the writer runs
    saver.wait()
    assert json.loads((tmp_path / "checkpoint" / "trainer.json").read_text()) == {"version": 0}
    assert load_checkpoint(tmp_path)["version"] == 0

    def full(self, directory, state=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer.save = full.__get__(trainer)
    saver.save(tmp_path, coord, rec)  # returns at once: the failure happens in the writer
    with pytest.raises(CheckpointWriteError):
        saver.save(tmp_path, coord, rec)
    saver.close()
    rec.close()
    assert load_checkpoint(tmp_path)["version"] == 0 and not (tmp_path / "checkpoint.tmp").exists()


def test_psrl_train_on_a_full_disk_says_so_in_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    """Real psrl train (tiny model, checkpoint every 2 steps, written in the background): the step-4 checkpoint
    hits ENOSPC. The run exits 1 with one line naming the checkpoint, the disk error and the fix; checkpoint/ is
    the step-2 one; the same command (disk freed) resumes and finishes with every step once."""
    from psrl.runtime.checkpoint import load_checkpoint
    from psrl.train import Trainer
    from psrl.train_cli import main
    from tests.runtime.test_train_cli_e2e import TINY

    real = Trainer.save

    def save(self, directory, state=None):
        if (state or {}).get("version", self.version) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, directory, state)

    monkeypatch.setattr(Trainer, "save", save)
    args = TINY + [f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=6"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "previous checkpoint is intact" in err
    assert err.startswith(f"psrl train: checkpoint {tmp_path / 'run' / 'checkpoint'}: could not be written"), err
    assert load_checkpoint(tmp_path / "run")["version"] == 2 and not (tmp_path / "run" / "checkpoint.tmp").exists()
    monkeypatch.setattr(Trainer, "save", real)
    assert main(args) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 7))
