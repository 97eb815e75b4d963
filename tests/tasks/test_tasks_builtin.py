"""Built-in tasks: registry, verifiable rewards, episode bookkeeping, demos and tool latency."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.config import ConfigError, TaskConfig
from psrl.runtime.vloop import run_virtual
from psrl.tasks import Segment, Task, get_task, lognormal_latency
from psrl.tasks.arith import ArithTask
from psrl.tasks.tool_arith import ToolArithTask


class ScriptedGenerate:
    """``generate`` that replays fixed model turns (log-prob -0.5, version 3) and counts calls."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)
        self.contexts: list[list[int]] = []

    async def __call__(self, context_ids, max_new_tokens):
        self.contexts.append(list(context_ids))
        toks = self.turns.pop(0)[:max_new_tokens]
        return Segment(toks, [-0.5] * len(toks), [3] * len(toks))


def _turns_of(task: ToolArithTask, response: list[int], mask: list[int]) -> list[list[int]]:
    """Split a scripted response into its model turns (maximal runs of mask-1 tokens)."""
    turns, cur = [], []
    for tok, m in zip(response, mask):
        if m:
            cur.append(tok)
        elif cur:
            turns.append(cur)
            cur = []
    return turns + ([cur] if cur else [])


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "name,cls", [("arith", ArithTask), ("tool_arith", ToolArithTask), ("psrl.tasks.arith:ArithTask", ArithTask)]
)
def test_registry_builds_by_name_or_module_class(name, cls):
    """task.name is a registered name or module:Class; task.kwargs reach the constructor."""
    task = get_task(TaskConfig(name=name, kwargs={"max_value": 5}), seed=0)
    assert isinstance(task, cls) and isinstance(task, Task) and task.max_value == 5


@pytest.mark.parametrize("name", ["nope", "psrl.tasks.arith:Missing", "no_such_module:X"])
def test_registry_rejects_unknown_tasks_naming_the_key(name):
    """A bad task name is a ConfigError naming task.name."""
    with pytest.raises(ConfigError, match="task.name"):
        get_task(TaskConfig(name=name))


# ---------------------------------------------------------------- arith


@settings(max_examples=40, deadline=None)
@given(a=st.integers(0, 9), b=st.integers(0, 9), delta=st.integers(-3, 3))
def test_arith_reward_is_one_exactly_for_the_sum(a, b, delta):
    """score = acc = 1 iff the answer before eos is a + b; all four metrics present."""
    task = ArithTask(TaskConfig(name="arith"))
    prompt = task.sample_prompt(random.Random(0))
    prompt.answer = a + b
    ep = asyncio.run(task.run_episode(prompt, ScriptedGenerate([task.answer_ids(a + b + delta)]), random.Random(0)))
    r = task.reward(prompt, ep)
    assert set(r) == {"score", "acc", "seq_reward", "seq_final_reward"}
    assert r["score"] == r["acc"] == float(delta == 0)


def test_arith_answer_without_eos_is_truncated_and_scores_zero():
    """A turn cut by the token budget is truncated, with reward 0 even if its digits are right."""
    task = ArithTask(TaskConfig(name="arith"))
    prompt = task.sample_prompt(random.Random(1))
    digits = task.tokenizer.encode(str(prompt.answer))
    ep = asyncio.run(task.run_episode(prompt, ScriptedGenerate([digits]), random.Random(0)))
    assert ep.truncated and task.reward(prompt, ep)["score"] == 0.0


# ---------------------------------------------------------------- tool_arith


@pytest.fixture
def tool_task():
    return ToolArithTask(TaskConfig(name="tool_arith", tool_latency_median=0.0))


@pytest.mark.parametrize("seed", range(6))
def test_expert_episode_scores_one_with_tool_tokens_masked(tool_task, seed):
    """Replaying the expert: reward 1; tool tokens have mask 0, log-prob 0.0, version -1; the model's
    turns keep theirs; one tool call per extra operand; contexts grow by exactly the turns + tool output."""
    task = tool_task
    prompt = task.sample_prompt(random.Random(seed))
    resp, mask = task.expert_response(prompt.text)
    gen = ScriptedGenerate(_turns_of(task, resp, mask))
    ep = asyncio.run(task.run_episode(prompt, gen, random.Random(0)))
    assert task.reward(prompt, ep)["score"] == 1.0
    assert ep.response_ids == resp and ep.loss_mask == mask
    assert ep.tool_calls == prompt.text.count("+") == ep.turns - 1
    for m, lp, v in zip(ep.loss_mask, ep.logprobs, ep.token_versions):
        assert (lp, v) == ((-0.5, 3) if m else (0.0, -1))
    assert gen.contexts[-1] == prompt.ids + ep.response_ids[: len(gen.contexts[-1]) - len(prompt.ids)]
    assert len(prompt.ids) + len(ep.response_ids) < 64


def test_lazy_answer_malformed_call_and_turn_limit(tool_task):
    """Answering a partial sum scores 0; a malformed call gets '?' and lowers seq_reward; an episode ends
    after task.max_turns model turns even without an answer."""
    task = tool_task
    tk = task.tokenizer
    prompt = task.sample_prompt(random.Random(0))
    prompt.text, prompt.answer = "1+2+3=", 6
    lazy = asyncio.run(
        task.run_episode(
            prompt, ScriptedGenerate([tk.encode("<call>1+2</call>"), task.answer_ids(3)]), random.Random(0)
        )
    )
    assert task.reward(prompt, lazy)["score"] == 0.0 and lazy.tool_calls == 1
    bad_call = tk.encode("<call>1+</call>")
    looping = asyncio.run(task.run_episode(prompt, ScriptedGenerate([bad_call] * 5), random.Random(0)))
    assert looping.turns == task.cfg.max_turns and not looping.truncated
    assert tk.decode(looping.response_ids).count("<res>?</res>") == task.cfg.max_turns
    r = task.reward(prompt, looping)
    assert r["score"] == 0.0 and r["seq_reward"] == pytest.approx(-0.1 * task.cfg.max_turns)


def test_demonstrations_mix_expert_and_lazy_and_are_reproducible(tool_task):
    """Demos are reproducible from the rng; a demo_lazy_prob fraction stops early (reward 0), the rest
    are the expert (reward 1); masks are 0 exactly on tool output."""
    task = tool_task
    demos = task.demonstrations(300, random.Random(7))
    assert demos == task.demonstrations(300, random.Random(7))
    full = 0
    for p_ids, resp, mask in demos:
        text = task.tokenizer.decode(resp)
        assert text.endswith("<eos>") and len(resp) == len(mask)
        inside = False
        for tok, m in zip(resp, mask):
            inside = inside or tok == task.res_id
            assert m == (0 if inside else 1)
            inside = inside and tok != task.end_res_id
        full += text.count("<call>") == task.tokenizer.decode(p_ids).count("+")
    assert abs(full / len(demos) - (1 - task.demo_lazy_prob)) < 0.08


# ---------------------------------------------------------------- latency


@pytest.mark.parametrize("median,sigma", [(0.05, 1.0), (2.0, 0.5)])
def test_latency_sampler_is_lognormal_with_the_configured_median_and_sigma(median, sigma):
    """log(latency) ~ Normal(log median, sigma): sample median and log-std match (seeded, 4000 draws)."""
    rng = random.Random(0)
    xs = [lognormal_latency(rng, median, sigma) for _ in range(4000)]
    logs = [math.log(x) for x in xs]
    assert statistics.median(xs) == pytest.approx(median, rel=0.08)
    assert statistics.pstdev(logs) == pytest.approx(sigma, rel=0.05)
    assert max(xs) / median > math.exp(2.5 * sigma)  # heavy right tail is really there


def test_zero_median_gives_zero_latency_but_consumes_the_same_draws():
    """Scaling latency to 0 (the sync loop) keeps the rng stream aligned with the real-latency run."""
    a, b = random.Random(5), random.Random(5)
    assert [lognormal_latency(a, 0.0, 1.0) for _ in range(10)] == [0.0] * 10
    [lognormal_latency(b, 1.0, 1.0) for _ in range(10)]
    assert a.random() == b.random()


def test_episode_waits_exactly_the_drawn_latencies_in_virtual_time():
    """On the virtual-time loop an expert episode takes exactly the sum of its tool latencies (no real
    sleep), and those are the task's draws from the episode rng."""
    task = ToolArithTask(TaskConfig(name="tool_arith", tool_latency_median=0.5, tool_latency_sigma=1.0))
    prompt = task.sample_prompt(random.Random(2))
    resp, mask = task.expert_response(prompt.text)

    async def timed():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ep = await task.run_episode(prompt, ScriptedGenerate(_turns_of(task, resp, mask)), random.Random(11))
        return ep, loop.time() - t0

    ep, elapsed = run_virtual(timed())
    replay = random.Random(11)
    expected = sum(task.tool_latency(replay) for _ in range(ep.tool_calls))
    assert ep.tool_calls >= 1 and elapsed == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_a_task_with_the_old_state_verbs_is_refused_at_definition():
    """state() / load_state() were renamed state_dict() / load_state_dict(): a task still defining them would not be
    checkpointed, so defining one raises, naming the new verbs."""
    from psrl.tasks.base import Task

    with pytest.raises(TypeError, match=r"defines state and load_state\(\).*state_dict\(\) / load_state_dict"):

        class Old(Task):  # noqa: F841 -- defining the class is what is tested
            def state(self) -> dict:
                return {}

            def load_state(self, state: dict) -> None:
                pass

    class New(Task):
        state = None  # an attribute of that name is fine; only a method is the old verb

        def state_dict(self) -> dict:
            return {}
