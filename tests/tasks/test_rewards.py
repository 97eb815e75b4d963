"""task.reward: built-ins, verl-style functions (sync/async, float/dict), timeouts and errors naming the reward."""

import asyncio

import pytest

from psrl.config import ConfigError
from psrl.tasks.rewards import RewardError, build_reward


def call(spec, solution, truth="7", timeout=5.0):
    return asyncio.run(build_reward(spec, timeout)("src", solution, truth, {}, where="f.jsonl row 3"))


@pytest.mark.parametrize(
    "spec,solution,score",
    [
        ("math", "so the answer is \\boxed{7}", 1.0),
        ("math", "14/2", 1.0),
        ("math", "8", 0.0),
        ("exact", " 7 ", 1.0),
        ("exact", "7.0", 0.0),
        ("regex:#### (\\d+)", "work... #### 7", 1.0),
        ("regex:#### (\\d+)", "7", 0.0),
        ("regex:\\d+", "x7y", 1.0),
    ],
)
def test_builtin_rewards(spec, solution, score):
    out = call(spec, solution)
    assert out["score"] == score and out["acc"] == score and out["seq_final_reward"] == score


def test_verl_functions_sync_dict_and_async_float():
    out = call("tests.tasks.reward_fns:compute_score", "7")
    assert out["score"] == 1.0 and out["acc"] == 1.0 and out["length"] == 1.0
    assert call("tests.tasks.reward_fns:async_score", "anything")["score"] == 0.5


def test_reward_from_a_python_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n")
    assert call(f"{f}:compute_score", "x")["score"] == 0.25


@pytest.mark.parametrize(
    "fn,match",
    [
        (
            "raising_score",
            r"reward tests.tasks.reward_fns:raising_score raised on f.jsonl row 3: ValueError\('grader exploded'\)",
        ),
        ("no_score", r"returned a dict without 'score' on f.jsonl row 3"),
        ("never_returns", r"timed out after 0.01s on f.jsonl row 3.*task.reward_timeout"),
    ],
)
def test_failures_raise_reward_error_naming_reward_and_row(fn, match):
    with pytest.raises(RewardError, match=match):
        call(f"tests.tasks.reward_fns:{fn}", "7", timeout=0.01)


def test_unloadable_reward_is_a_config_error():
    with pytest.raises(ConfigError, match="task.reward"):
        build_reward("tests.tasks.reward_fns:missing", 1.0)
    with pytest.raises(ConfigError, match="task.reward"):
        build_reward("regex:(", 1.0)
