"""``task.reward: judge``: a model grades through an OpenAI-compatible endpoint, bounded, retried, never lost."""

import asyncio

import pytest

pytest.importorskip("starlette", reason="the fake judge is served with the agents extra")
from psrl.config import ConfigError, load_config
from psrl.runtime.recorder import read_jsonl
from psrl.tasks.rewards import RewardError, build_reward
from psrl.train_cli import main
from tests.tasks.fake_judge import FakeJudge
from tests.tasks.test_dataset import TINY, sums, write_jsonl


def judge_cfg(url, *overrides):
    return load_config(None, ["task.reward=judge", f"task.judge.url={url}", *overrides]).task


def score(task_cfg, answers, truth="5"):
    fn = build_reward(task_cfg.reward, task_cfg.reward_timeout, judge=task_cfg.judge)

    async def run():
        return await asyncio.gather(
            *(fn("s", a, truth, {"question": "2+3?"}, where="f.jsonl row 0") for a in answers), return_exceptions=True
        )

    return asyncio.run(run())


def test_the_judges_reply_is_the_score():
    with FakeJudge() as judge:
        right, wrong = score(judge_cfg(judge.url), ["5", "6"])
    assert right["score"] == 1.0 and wrong["score"] == 0.0 and judge.requests == 2


def test_at_most_concurrency_requests_reach_the_judge_at_once():
    with FakeJudge(hold=0.05) as judge:
        out = score(judge_cfg(judge.url, "task.judge.concurrency=2"), ["5"] * 8)
    assert [o["score"] for o in out] == [1.0] * 8
    assert judge.most_in_flight <= 2


@pytest.mark.parametrize(
    ("judge", "words"),
    [
        (dict(hang_on="Answer to grade"), "failed 2 times; last: no reply within task.judge.timeout=0.2s"),
        (dict(garbage=True), "does not match task.judge.parse"),
    ],
)
def test_a_judge_that_hangs_or_talks_nonsense_fails_the_call_after_its_retries(judge, words):
    with FakeJudge(**judge) as fake:
        (err,) = score(judge_cfg(fake.url, "task.judge.timeout=0.2", "task.judge.retries=1"), ["5"])
    assert isinstance(err, RewardError) and words in str(err) and fake.requests == 2


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["task.reward=judge"], "task.judge.url"),
        (["task.reward=judge", "task.judge.url=http://x/v1", "task.judge.prompt={nope}"], "task.judge.prompt"),
        (["task.reward=judge", "task.judge.url=http://x/v1", "task.judge.parse=("], "task.judge.parse"),
        (["task.reward=judge", "task.judge.url=http://x/v1", "task.judge.timeout=20"], "task.judge.timeout"),
    ],
)
def test_a_judge_config_that_cannot_work_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_a_hanging_judge_fails_its_groups_visibly_and_the_run_goes_on(tmp_path):
    """Rows whose reference is 7 (half of them) are never graded: their trajectories are recorded ``error`` after the judge's
    retries, within task.reward_timeout; every step trains, within the bound; nothing else is lost."""
    rows = sums(8)
    for r in rows[::2]:
        r["reward_model"]["ground_truth"] = "7"  # half the rows: a run of 3 steps draws some
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    run_dir = tmp_path / "run"
    with FakeJudge(hang_on="Reference answer: 7 ") as judge:
        code = main(
            TINY
            + [
                f"data.train_files={f}",
                "task.reward=judge",
                f"task.judge.url={judge.url}",
                "task.judge.timeout=1",
                "task.judge.retries=1",
                "task.reward_timeout=3",
                "task.reward_retries=0",
                "trainer.total_steps=3",
                f"trainer.run_dir={run_dir}",
            ]
        )
    assert code == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    records = read_jsonl(run_dir / "trajectories.jsonl")
    trained = [r for r in records if r["status"] == "trained"]
    bound = load_config(None, TINY + [f"data.train_files={f}"]).psrl.staleness
    assert len(trained) == 3 * 2 * 2 and all(0 <= r["consumed_version"] - r["v_traj"] <= bound for r in trained)
    hung = [r for r in records if r["status"] == "error"]
    sevens = [i for i, r in enumerate(rows) if r["reward_model"]["ground_truth"] == "7"]
    assert hung and all("judge" in r["error"] and "task.judge.timeout=1s" in r["error"] for r in hung)
    assert all(r["error"].split("row ")[1][0] in {str(i) for i in sevens} for r in hung)
    assert {r["status"] for r in records} <= {"trained", "error", "held", "aborted", "cancelled"}
