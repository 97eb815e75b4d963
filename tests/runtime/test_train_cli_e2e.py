"""``psrl train`` end to end with the real tiny model and the agentic task (a few seconds)."""

import yaml

from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.rollout.harness import check_bound

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "trainer.warm_start_steps=5",
        "psrl.staleness_buffer_entries=2", "psrl.rollout_n=2", "psrl.max_concurrent_per_instance=2",
        "task.tool_latency_median=0.01", "trainer.checkpoint_every=2"]


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
    for key in ("time", "reward/mean", "staleness/mean", "staleness/max", "counts/generated", "counts/aborted",
                "counts/filtered", "counts/retried", "counts/truncated"):
        assert key in metrics[-1], key
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
    assert len({t["uid"] for t in trajs}) == len(trajs)


def test_psrl_train_reports_config_errors_with_the_key(capsys):
    """A bad override exits 2 and names the key and the fix."""
    assert main(["psrl.redundant_rollout.redundant_rollout_n=1", "psrl.rollout_n=4"]) == 2
    err = capsys.readouterr().err
    assert "psrl.redundant_rollout.redundant_rollout_n" in err and "fix" in err
