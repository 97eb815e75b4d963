"""Watching a run: TensorBoard and wandb-offline files, validation rows, plain lines off a terminal."""

import pytest

from psrl.metrics import checked
from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.runtime.test_train_cli_e2e import TINY as BUILTIN  # the tiny built-in run the CLI tests use
from tests.tasks.test_dataset import TINY, sums, write_jsonl


def test_tensorboard_scalars_read_back_with_tensorboards_own_reader(tmp_path):
    """Every numeric metric of metrics.jsonl is a TensorBoard scalar at its step, with the same value."""
    pytest.importorskip("tensorboard", reason="the [track] extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert (
        main(BUILTIN + ["trainer.total_steps=2", f"trainer.run_dir={run_dir}", "trainer.logger=[console,tensorboard]"])
        == 0
    )
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "staleness/max", "train/loss"} <= tags
    for key in ("reward/mean", "staleness/max", "train/loss"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)


def test_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the [track] extra is not installed")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    assert main(BUILTIN + ["trainer.total_steps=1", f"trainer.run_dir={run_dir}", "trainer.logger=[wandb]"]) == 0
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_no_console_logger_means_no_step_lines(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(BUILTIN + ["trainer.total_steps=1", f"trainer.run_dir={run_dir}", "trainer.logger=[]"]) == 0
    assert "step   1/1" not in capsys.readouterr().out
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 1  # metrics.jsonl is written whatever the loggers


def test_validation_rows_every_val_every_steps_and_at_the_end(tmp_path):
    """val/accuracy, val/reward, val/pass@k at steps 2 and 3 (the last), with the step and the version;
    the validation set is data.val_files; step rows are unchanged."""
    train = write_jsonl(tmp_path / "train.jsonl", sums(16))
    val = write_jsonl(tmp_path / "val.jsonl", sums(5, seed=1))
    run_dir = tmp_path / "run"
    assert (
        main(
            TINY
            + [
                f"data.train_files={train}",
                f"data.val_files={val}",
                "trainer.total_steps=3",
                "trainer.val_every=2",
                "trainer.val_n=3",
                f"trainer.run_dir={run_dir}",
            ]
        )
        == 0
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    val_rows = [r for r in rows if "val/accuracy" in r]
    assert [(r["step"], r["version"]) for r in val_rows] == [(2, 2), (3, 3)]
    for r in val_rows:
        assert r["val/prompts"] == 5 and r["val/k"] == 3 and 0 <= r["val/accuracy"] <= r["val/pass@k"] + 1
        assert "time" not in r  # replay tools count steps by 'time'
    assert [r["step"] for r in rows if "time" in r] == [1, 2, 3]
    assert all(checked(r) for r in rows)  # every key in the metric table; step and version in every row


def test_validation_of_a_builtin_task_is_repeatable(tmp_path):
    """Same weights, same validation, on one engine or spread over two: every episode samples from its own stream;
    the policy's generator is untouched."""
    import asyncio

    from psrl.config import load_config
    from psrl.rollout.engines.hf import HFEngine
    from psrl.runtime.validate import validate
    from psrl.train import build_task_and_policy

    cfg = load_config(None, BUILTIN + ["task.name=arith"])
    task, policy = build_task_and_policy(cfg)
    prompts = task.val_prompts(8)
    before = policy.generator.get_state()

    async def on(engines):  # an engine lives on one event loop
        try:
            return await validate(task, engines, prompts, 2, 1.0, 1.0, seed=0)
        finally:
            for e in engines:
                await e.close()

    a = asyncio.run(on([HFEngine(policy)]))
    b = asyncio.run(on([HFEngine(policy), HFEngine(policy.replica(seed=5))]))  # spread over two: the same numbers
    assert {k: v for k, v in a.items() if k != "val/seconds"} == {k: v for k, v in b.items() if k != "val/seconds"}
    assert bool((policy.generator.get_state() == before).all())
    assert [p.text for p in task.val_prompts(8)] == [p.text for p in prompts]


async def _scored_once(task, engine, prompts, stream):
    from psrl.runtime.validate import _scored

    try:
        return await _scored(task, [engine], 1.0, 1.0, prompts, 4, "val/sampled", stream)
    finally:
        await engine.close()


def test_validation_samples_do_not_depend_on_the_other_prompts_in_the_batch():
    """Sampled validation of 8 prompts and of their first 3: the first 3 prompts' episodes have the same tokens
    (each episode has its own stream, so its tokens do not depend on the requests it shared decode steps with);
    another stream gives other tokens."""
    import asyncio
    from collections import Counter

    from psrl.config import load_config
    from psrl.rollout.engines.hf import HFEngine
    from psrl.train import build_task_and_policy

    cfg = load_config(None, BUILTIN + ["task.name=arith"])
    task, policy = build_task_and_policy(cfg)
    prompts = task.val_prompts(8)

    class Recording:
        """The task, recording each episode's prompt and response tokens."""

        def __init__(self, inner):
            self.inner, self.seen = inner, Counter()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def run_episode(self, prompt, generate, rng):
            ep = await self.inner.run_episode(prompt, generate, rng)
            self.seen[(prompt.uid, tuple(ep.response_ids))] += 1
            return ep

    def sampled(ps, stream):
        rec = Recording(task)
        asyncio.run(_scored_once(rec, HFEngine(policy), ps, stream))
        return rec.seen

    first3 = {p.uid for p in prompts[:3]}
    every = sampled(prompts, 11)
    alone = sampled(prompts[:3], 11)
    assert alone == Counter({k: n for k, n in every.items() if k[0] in first3}) and sum(alone.values()) == 12
    assert sampled(prompts[:3], 12) != alone


def test_a_terminal_gets_a_progress_bar_instead_of_lines(tmp_path):
    from types import SimpleNamespace

    from psrl.config import load_config
    from psrl.runtime.watch import RunWatch

    cfg = load_config(None, ["trainer.total_steps=4"])
    lines = []
    recorder = SimpleNamespace()
    watch = RunWatch(cfg, tmp_path, SimpleNamespace(version=1), recorder, lines.append, lambda r, t: "line", tty=True)
    watch.after_step({"step": 2, "reward/mean": 0.5, "staleness/mean": 1.0, "staleness/max": 2})
    assert watch.bar.bar.n == 2 and watch.bar.bar.total == 4 and lines == []
    watch.close()
    plain = RunWatch(cfg, tmp_path, SimpleNamespace(version=0), recorder, lines.append, lambda r, t: "line", tty=False)
    plain.after_step({"step": 1})
    assert plain.bar is None and lines == ["line"]
