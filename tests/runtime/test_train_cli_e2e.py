"""``psrl train`` end to end with the real tiny model and the agentic task (a few seconds)."""

import pytest
import yaml

from psrl.metrics import INDEX, METRICS, checked
from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.rollout.harness import check_bound

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "trainer.warm_start_steps=5",
    "psrl.staleness_buffer_entries=2",
    "psrl.rollout_n=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=2",
    "task.tool_latency_median=0.01",
    "trainer.checkpoint_every=2",
]


def test_psrl_train_writes_a_complete_resumable_run_dir(tmp_path):
    """A 3-step run writes config.yaml, metrics.jsonl, trajectories.jsonl, final weights and a checkpoint;
    every trained trajectory is within psrl.staleness; rerunning with more steps resumes instead of restarting."""
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "psrl.staleness=1"]
    assert main(args + ["trainer.total_steps=3"]) == 0
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["psrl"]["staleness"] == 1 and cfg["trainer"]["total_steps"] == 3
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(checked(m) for m in metrics)  # every key is in the one metric-name table, step and version too
    families = {f"{m.name[:-1]}{x}" for m in METRICS for x in m.members}
    assert families | set(INDEX) <= set(metrics[-1])  # every listed family member is written (none is stale)
    for key in (
        "time",
        "reward/mean",
        "staleness/mean",
        "staleness/max",
        "counts/generated",
        "counts/aborted",
        "counts/filtered",
        "counts/retried",
        "counts/truncated",
    ):
        assert key in metrics[-1], key
    assert metrics[-1]["staleness/consumes"] == 3 and metrics[-1]["staleness/occupies"] >= 3 * 2  # the manager's Stats
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(trajs, 1) == 3 * 2 * 2
    assert all("gen_seconds" in t and "segment_versions" in t for t in trajs)
    assert (run_dir / "final" / "config.json").exists() and (run_dir / "final" / "tokenizer.json").exists()
    assert (run_dir / "final" / "psrl_version.txt").read_text().strip() == "3"
    assert (run_dir / "checkpoint" / "trainer.pt").exists()

    assert main(args + ["trainer.total_steps=4"]) == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(trajs, 1) == 4 * 2 * 2

    # trainer.resume=false starts over: the logs hold this run only, the earlier run is set aside whole
    assert main(args + ["trainer.total_steps=2", "trainer.resume=false"]) == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 1) == 2 * 2 * 2
    (aside,) = (run_dir / "previous").iterdir()
    assert [m["step"] for m in read_jsonl(aside / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (aside / "checkpoint" / "trainer.pt").exists() and (run_dir / "checkpoint" / "trainer.pt").exists()
    assert len({t["uid"] for t in trajs}) == len(trajs)


def test_psrl_train_reports_config_errors_with_the_key(capsys):
    """A bad override exits 2 and names the key and the fix."""
    assert main(["psrl.redundant_rollout.redundant_rollout_n=1", "psrl.rollout_n=4"]) == 2
    err = capsys.readouterr().err
    assert "psrl.redundant_rollout.redundant_rollout_n" in err and "fix" in err


def _signal_during_step(monkeypatch, sig, at):
    """Make the real trainer's step ``at`` send ``sig`` to the main thread (as a terminal or a scheduler
    would) and hold on until the coordinator has reported the interrupt, so it lands inside the step."""
    import signal
    import threading

    import psrl.runtime.local as local
    from psrl.train import Trainer

    seen = threading.Event()

    class Coordinator(local.Coordinator):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            say = self.log
            self.log = lambda msg: (say(msg), seen.set())

    real_step = Trainer.step

    def step(self, batch):
        if int(batch.version) + 1 == at:
            signal.pthread_kill(threading.main_thread().ident, sig)
            assert seen.wait(timeout=60), "the coordinator never reported the interrupt"
        return real_step(self, batch)

    monkeypatch.setattr(local, "Coordinator", Coordinator)
    monkeypatch.setattr(Trainer, "step", step)
    return lambda: monkeypatch.setattr(Trainer, "step", real_step)


@pytest.fixture
def ctrl_c_as_in_a_terminal():
    """SIGINT raises KeyboardInterrupt, as in a terminal. A job a non-interactive shell starts with `&` inherits
    SIGINT ignored; Python then installs no KeyboardInterrupt handler and asyncio.run none of its own, so Ctrl-C
    would do nothing (as for any program started that way) and this test would measure its launcher."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_ctrl_c_during_a_training_step_finishes_it_checkpoints_and_resumes(tmp_path, monkeypatch, capsys):
    """SIGINT while step 2 trains: psrl train finishes and records step 2, checkpoints at version 2 and
    exits 130; the same command then continues at step 3."""
    import signal

    from psrl.cli import main as psrl_main

    undo = _signal_during_step(monkeypatch, signal.SIGINT, at=2)
    run_dir = tmp_path / "run"
    args = ["train"] + TINY + [f"trainer.run_dir={run_dir}", "trainer.checkpoint_every=100"]
    assert psrl_main(args + ["trainer.total_steps=6"]) == 130
    out = capsys.readouterr()
    assert "finishing training step 2" in out.out and "interrupted; resume with" in out.err
    assert out.err.count("trainer.run_dir=") == 1  # the run directory is named once in the resume hint
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]

    undo()
    assert psrl_main(args + ["trainer.total_steps=4"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len({t["uid"] for t in trajs}) == len(trajs)
    assert check_bound(trajs, 2) == 4 * 2 * 2


def test_sigterm_is_handled_like_ctrl_c(tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM during step 2: the step finishes, the run checkpoints and exits 143, the
    SIGTERM handler is removed again, and the same command resumes the run."""
    import signal

    undo = _signal_during_step(monkeypatch, signal.SIGTERM, at=2)
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "trainer.checkpoint_every=100"]
    assert main(args + ["trainer.total_steps=6"]) == 143
    out = capsys.readouterr()
    assert "finishing training step 2" in out.out and "terminated; resume with" in out.err
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    undo()
    assert main(args + ["trainer.total_steps=3"]) == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_a_trainer_crash_resumes_from_the_last_periodic_checkpoint(tmp_path, monkeypatch, capsys):
    """The trainer raises in step 3 (checkpoint_every=2): events.jsonl was already on disk for steps 1-2
    (as after a kill), the error is reported in one line (exit 1), the checkpoint stays at version 2, and rerunning redoes
    step 3 once -- no step lost or recorded twice."""
    from psrl.train import Trainer
    from psrl.viz.events import read_events

    real_step = Trainer.step
    on_disk = []

    def crash_at_3(self, batch):
        if int(batch.version) + 1 == 3:
            on_disk.extend(read_events(run_dir / "events.jsonl"))
            raise RuntimeError("out of memory (simulated)")
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "step", crash_at_3)
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "trainer.total_steps=4"]
    monkeypatch.delenv("PSRL_DEBUG", raising=False)
    assert main(args) == 1
    assert "RuntimeError: out of memory (simulated)" in capsys.readouterr().err
    assert {e["buffer"] for e in on_disk if e["kind"] == "consume"} >= {0, 1}
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(Trainer, "step", real_step)
    assert main(args) == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len({t["uid"] for t in trajs}) == len(trajs)
    assert check_bound(trajs, 2) == 4 * 2 * 2
