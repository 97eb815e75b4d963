"""The ``arith2`` example dataset (``examples/arith2``): verl's layout, right answers, a strict ``#### N`` reward."""

import asyncio
import importlib.util
import random
from pathlib import Path

import pytest

from psrl.config import load_config
from psrl.tasks import get_task
from psrl.tasks.rewards import build_reward
from tests.tasks.test_dataset import TINY

HERE = Path(__file__).resolve().parents[2] / "examples" / "arith2"
REWARD = f"{HERE / 'reward.py'}:compute_score"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"arith2_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = _module("data")


def _answer(q: str) -> int:
    a, op, b = q.partition("+") if "+" in q else q.partition("*")
    return int(a) + int(b) if op == "+" else int(a) * int(b)


def test_rows_are_verls_layout_with_right_answers_and_disjoint_splits():
    out = data.rows(300, 40, seed=3)
    assert [len(out["train"]), len(out["val"])] == [300, 40]
    questions = {split: [r["extra_info"]["question"] for r in rs] for split, rs in out.items()}
    assert not set(questions["train"]) & set(questions["val"])
    assert len(set(questions["train"])) == 300
    for split, rs in out.items():
        for i, r in enumerate(rs):
            assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            q = r["extra_info"]["question"]
            assert r["reward_model"] == {"style": "rule", "ground_truth": str(_answer(q))}
            assert r["extra_info"]["split"] == split and r["extra_info"]["index"] == i
            assert [m["role"] for m in r["prompt"]] == ["user", "assistant", "user"] and q in r["prompt"][-1]["content"]
    ops = [q[2] for q in questions["train"]]  # both kinds of question, two-digit first operand
    assert 0.35 < ops.count("+") / len(ops) < 0.65 and set(ops) == {"+", "*"}
    assert data.rows(300, 40, seed=3) == out and data.rows(300, 40, seed=4) != out


@pytest.mark.parametrize(
    "reply, score",
    [
        ("47+38 = 85\n#### 85", 1.0),
        ("#### 1,085", 0.0),  # a wrong number, commas dropped before comparing
        ("47+38 = 85", 0.0),  # no #### at all: strict, like verl's GSM8K score
        ("#### 84\nno wait\n#### 85", 1.0),  # the last #### counts
        ("#### 85.0", 0.0),
        ("####85", 1.0),
        ("#### 85.", 1.0),
    ],
)
def test_the_reward_file_scores_only_the_answer_after_hashes(reply, score):
    fn = build_reward(REWARD, timeout=5.0)  # loaded the way task.reward=file.py:function loads it
    out = asyncio.run(fn("arith2", reply, "85", {}))
    assert out["score"] == score


def test_the_generated_parquet_loads_as_a_dataset_task(tmp_path):
    paths = data.write(tmp_path, n_train=16, n_val=4, seed=0)
    cfg = load_config(
        None,
        TINY
        + [
            f"data.train_files={paths['train']}",
            "model.n_positions=256",
            "data.max_prompt_length=192",
            f"task.reward={REWARD}",
        ],
    )
    task = get_task(cfg.task, seed=0, data=cfg.data)
    p = task.sample_prompt(random.Random(0))
    assert p.info["data_source"] == "arith2" and p.answer == str(_answer(p.info["extra_info"]["question"]))
