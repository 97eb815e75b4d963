"""``task.name=verifiers``: a verifiers (0.3.1, classic stack) environment played through the agent endpoint,
its rubric the reward -- the example environment (examples/verifiers_tool) end to end, and bad ``task.verifiers``."""

import asyncio
import random
import re

import pytest

pytest.importorskip(
    "verifiers", reason="task.name=verifiers needs the verifiers extra: pip install -e '.[agents,verifiers]'"
)

from psrl.config import load_config
from psrl.errors import ConfigError
from psrl.rollout.client.rewards import RewardTimeout, TaskReward
from psrl.rollout.engines.base import turns
from psrl.runtime.recorder import read_jsonl
from psrl.tasks import get_task
from psrl.tasks.base import Episode
from psrl.train_cli import main
from tests.agents import vf_envs
from tests.agents.conftest import play_scripted, scripted_engine
from tests.agents.vf_envs import SAID_WEIGHT
from tests.rollout.harness import check_bound

EXAMPLE = "examples/verifiers_tool/env.py:load_environment"
CONTEXT = ["data.max_prompt_length=1400", "model.n_positions=1600"]  # the Hermes tool turn, one char a token
SMALL_MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]


def test_the_example_environment_calls_its_tool_and_its_rubric_scores(tmp_path):
    """A model scripted to call the calculator on the row and copy the result: the environment runs the tool, its
    rubric gives 1.0 (right) + 0.2 (called the calculator), and the captured trajectory holds both turns."""
    cfg = load_config(
        None, ["task.name=verifiers", f"task.verifiers={EXAMPLE}", *CONTEXT, "data.max_response_length=96"]
    )
    task = get_task(cfg.task, seed=0, data=cfg.data)
    row = task.rows[task.order[0]].raw
    expression = re.search(r"\d+ \* \d+", row["question"]).group(0)
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    ep, reward = play_scripted(task, [call, f"It is {row['answer']}."])
    assert reward["score"] == pytest.approx(1.2)
    assert reward["correct_answer"] == 1.0 and reward["calculator_calls"] == 1.0 and reward["tool_calls"] == 1.0
    text = task.tokenizer.decode(ep.response_ids)
    assert f"<tool_response>\n{row['answer']}\n</tool_response>" in text and text.endswith(
        f"It is {row['answer']}.<eos>"
    )
    assert sum(ep.loss_mask) == len(call) + len(f"It is {row['answer']}.") + 2  # both turns and their eos


def test_the_example_demonstration_is_the_trajectory_the_environment_would_capture():
    """The example's demonstration(row) (the environment's own prompt and tool, a calculator call, its result),
    tokenised for the warm start, equals what the endpoint captures when the model samples those turns inside
    the environment's rollout: verifiers' requests render exactly as the demonstration does."""
    cfg = load_config(
        None,
        [
            "task.name=verifiers",
            f"task.verifiers={EXAMPLE}",
            f"task.demonstration={EXAMPLE.replace('load_environment', 'demonstration')}",
            *CONTEXT,
            "data.max_response_length=96",
        ],
    )
    task = get_task(cfg.task, seed=0, data=cfg.data)
    [(prompt_ids, response_ids, mask)] = task.demonstrations(1, random.Random(0))
    text = task.tokenizer.decode(prompt_ids + response_ids)
    row = next(r.raw for r in task.rows if r.raw["question"] in text)
    task.order = [task.rows.index(next(r for r in task.rows if r.raw is row))] + task.order
    expression = re.search(r"\d+ \* \d+", row["question"]).group(0)
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    ep, reward = play_scripted(task, [call, row["answer"]])
    assert reward["score"] == pytest.approx(1.2)
    assert (prompt_ids, response_ids, mask) == (ep.prompt_ids, ep.response_ids, ep.loss_mask)


def test_a_truncated_trajectory_without_a_finished_rollout_is_scored_as_an_empty_answer():
    """The proactive filter's truncate completes a trajectory whose rollout never finished (no state for the
    rubric): task.reward scores an empty answer, as for an agent, instead of failing the trajectory."""
    cfg = load_config(None, ["task.name=verifiers", f"task.verifiers={EXAMPLE}", "task.reward=exact", *CONTEXT])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    prompt = task.sample_prompt(random.Random(0))
    partial = Episode(truncated=True)
    partial.info["partial"] = True
    reward = asyncio.run(task.reward(prompt, partial))
    assert reward["score"] == 0.0 and reward["tool_calls"] == 0.0


def test_a_verifiers_environment_trains_20_steps_within_the_bound_scored_by_its_rubric(tmp_path):
    """``psrl train`` on the example environment (plus a reward function of the reply's length) with the built-in
    model: 20 steps, every trained trajectory within the bound, and each reward is the rubric's weighted sum
    recomputed from the tokens the trajectory recorded."""
    run_dir = tmp_path / "run"
    args = [
        *SMALL_MODEL,
        "psrl.rollout_n=2",
        "psrl.staleness=1",
        "psrl.staleness_buffer_entries=2",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
        "data.max_response_length=8",
        *CONTEXT,
        "trainer.total_steps=20",
        "trainer.checkpoint_every=100",
        "task.name=verifiers",
        "task.verifiers=tests.agents.vf_envs:calculator_env_scoring_length",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(args) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 21))
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(records, 1) == 20 * 2 * 2  # steps x groups x N
    from psrl.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    trained = [r for r in records if r["status"] == "trained"]
    for r in trained:  # one turn each: the tiny model never writes a tool call
        reply = tok.decode([t for t in r["response_ids"] if t != tok.eos_id])
        assert r["reward"] == pytest.approx(SAID_WEIGHT * len(reply)), r
    assert any(r["reward"] > 0 for r in trained)


@pytest.mark.parametrize(
    "verifiers, says",
    [
        ("examples/verifiers_tool/env.py", "names no function"),
        ("tests.agents.vf_envs:not_an_environment", "not a verifiers.Environment"),
        ("tests.agents.vf_envs:raises", "environment build failed"),
        ("tests.agents.vf_envs:no_such_function", "cannot load"),
        ("examples/verifiers_tool/missing.py:load_environment", "cannot load"),
    ],
)
def test_a_bad_task_verifiers_is_one_config_error_naming_the_key(verifiers, says):
    """Caught at load (no function named) or when the task is built (cannot load, raises, not an environment)."""
    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, ["task.name=verifiers", f"task.verifiers={verifiers}"])
        get_task(cfg.task, seed=0, data=cfg.data)
    assert e.value.key == "task.verifiers" and says in str(e.value) and "\n" not in str(e.value)


def test_data_files_are_refused_for_a_verifiers_task(tmp_path):
    """The rows are the environment's: a data file given beside it would be silently unused, so it is an error."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=verifiers", f"task.verifiers={EXAMPLE}", f"data.train_files={rows}"])
    assert e.value.key == "data.train_files"


def test_a_reward_function_that_never_returns_leaves_the_run_loop_free():
    """verifiers calls a synchronous reward function inline; psrl scores on the rubric's own loop, so while one
    hangs the run's event loop keeps serving (here: a ticking coroutine), and the score times out as a failure."""
    cfg = load_config(
        None,
        [
            "task.name=verifiers",
            "task.verifiers=tests.agents.vf_envs:calculator_env_hanging_reward",
            *CONTEXT,
            "data.max_response_length=16",
        ],
    )
    task = get_task(cfg.task, seed=0, data=cfg.data)
    _, engine = scripted_engine(task, ["I do not know."])

    async def run():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        prompt = task.sample_prompt(random.Random(0))
        ep = await task.run_episode(prompt, turns(engine), random.Random(0))
        ticker = asyncio.ensure_future(tick())
        try:
            with pytest.raises(RewardTimeout):
                await TaskReward(task, 0.5)(prompt, ep)
        finally:
            ticker.cancel()
            vf_envs.RELEASE.set()
            await task.close()
            await engine.close()
        return ticks

    assert asyncio.run(run()) > 1


def test_task_verifiers_fuzzed_loads_or_names_a_task_key():
    """Every edge value the config fuzzer gives a string key (tests/test_config_fuzz.py), as task.verifiers of a
    verifiers task, through the config load and the task's build: a ConfigError naming a task.* key, or a task."""
    from tests.test_config_fuzz import TARGETS, nasty

    for value in [*nasty("task.verifiers"), *TARGETS, "examples/verifiers_tool/env.py:calculator"]:
        try:
            cfg = load_config(None, ["task.name=verifiers", f"task.verifiers={value}"])
            get_task(cfg.task, seed=0, data=cfg.data)
        except ConfigError as e:
            assert e.key.startswith("task.") and "\n" not in str(e), (value, str(e))


def test_validation_on_an_environment_without_an_eval_dataset_stops_the_run_before_its_first_step(tmp_path, capsys):
    """``trainer.val_every`` > 0 on an environment with no eval_dataset: one config error naming the key, before any
    step is trained (the validation set is read at start, not at the first validation)."""
    run_dir = tmp_path / "run"
    args = [
        *SMALL_MODEL,
        "psrl.rollout_n=2",
        *CONTEXT,
        "trainer.total_steps=3",
        "trainer.val_every=2",
        "task.name=verifiers",
        f"task.verifiers={EXAMPLE}",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(args) == 2  # ConfigError's exit code
    err = capsys.readouterr().err
    assert "trainer.val_every" in err and "eval_dataset" in err and "fix:" in err
    metrics = run_dir / "metrics.jsonl"
    assert not (read_jsonl(metrics) if metrics.exists() else [])  # no step trained, none validated
