"""Token-exact capture through the endpoint: what is stored is what the engine sampled, turn by turn."""

import asyncio
import random

import openai
import pytest

from psrl.errors import ConfigError
from psrl.rollout.engines.base import turns
from psrl.tasks.agent.task import AgentError
from psrl.types import segment_versions
from tests.agents import agent_fns
from tests.agents.conftest import CALL, scripted_engine


def play(task, engine, generate=None):
    """One episode of the task's first row on ``engine``; the episode and the reward."""

    async def run():
        try:
            prompt = task.sample_prompt(random.Random(0))
            ep = await task.run_episode(prompt, generate or turns(engine), random.Random(0))
            return ep, await task.reward(prompt, ep)
        finally:
            await task.close()
            await engine.close()

    agent_fns.SEEN.clear()
    return asyncio.run(run())


def test_a_tool_call_round_trip_stores_exactly_the_sampled_tokens(make_task):
    """The call is parsed into tool_calls, sent back by the agent, recognised, and replaced by its stored tokens;
    the tool result is context (mask 0, version -1); the logprobs the agent got count the trained tokens."""
    task = make_task("tool_agent")
    model, engine = scripted_engine(task, [CALL, "5"])
    ep, reward = play(task, engine)
    first, second = agent_fns.SEEN
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert second.choices[0].message.content == "5"
    sampled = [t for call in model.sampled for t in call]
    trained = [t for t, m in zip(ep.response_ids, ep.loss_mask) if m]
    assert trained == sampled
    assert sum(ep.loss_mask) == sum(len(r.choices[0].logprobs.content) for r in agent_fns.SEEN)
    assert all(v == -1 for v, m in zip(ep.token_versions, ep.loss_mask) if not m) and 0 in ep.loss_mask
    tool_text = task.tokenizer.decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if not m])
    assert "<tool_response>\n5\n</tool_response>" in tool_text
    assert reward["score"] == 1.0 and reward["tool_calls"] == 1.0
    assert first.usage.completion_tokens + second.usage.completion_tokens == sum(ep.loss_mask)
    assert second.usage.prompt_tokens == len(ep.prompt_ids) + len(ep.response_ids) - second.usage.completion_tokens


def test_a_weight_update_between_turns_gives_the_tokens_two_versions(make_task):
    """Every token keeps the version that produced it: weights loaded between the turns show as two segments."""
    task = make_task("tool_agent")
    model, engine = scripted_engine(task, [CALL, "5"])
    inner = turns(engine)

    async def generate(context, budget):
        seg = await inner(context, budget)
        model.version += 1  # the next turn runs on the next version
        return seg

    ep, _ = play(task, engine, generate)
    assert segment_versions(ep.token_versions) == [0, 1]


def test_a_history_the_agent_rewrote_is_refused_naming_the_cause(make_task):
    """An assistant turn sent back changed cannot be replaced by its tokens: the request fails, never trains on a
    re-tokenisation."""
    task = make_task("rewriting_agent")
    _, engine = scripted_engine(task, ["7", "8"])
    with pytest.raises(openai.BadRequestError) as err:
        play(task, engine)
    assert "does not extend" in str(err.value) and err.value.code == "history_mismatch"


def test_the_agents_own_reward_is_used_when_it_returns_one(make_task):
    task = make_task("scoring_agent")
    _, engine = scripted_engine(task, ["9"])
    ep, reward = play(task, engine)
    assert (reward["score"], reward["acc"], reward["tool_calls"]) == (0.25, 1.0, 0.0)


def test_without_a_reward_the_last_assistant_message_is_scored(make_task):
    task = make_task("tool_agent")
    _, engine = scripted_engine(task, ["6"])
    ep, reward = play(task, engine)
    assert ep.info["solution"] == "6" and reward["score"] == 0.0 and ep.turns == 1


@pytest.mark.parametrize(
    ("agent", "error", "words"),
    [
        ("silent_agent", AgentError, "without calling the endpoint"),
        ("raising_agent", ValueError, "the agent's own bug"),
        ("hanging_agent", AgentError, "task.agent_timeout=0.5"),
    ],
)
def test_an_agent_that_fails_fails_its_episode(make_task, agent, error, words):
    """The agent manager retries / records these as it does any failing episode (tests/rollout)."""
    task = make_task(agent, "task.agent_timeout=0.5")
    _, engine = scripted_engine(task, ["1"])
    with pytest.raises(error, match=words):
        play(task, engine)


def test_an_agent_that_is_not_async_is_a_config_error(make_task):
    with pytest.raises(ConfigError, match="task.agent"):
        make_task("not_async_agent")


def test_through_a_session_v_traj_is_the_version_the_session_opened_at(make_task):
    """On the real rollout instance: weights published during the episode are loaded between its turns; the
    trajectory keeps ``V_traj`` = the first version, its tokens both, and the session's record agrees."""
    from psrl.rollout.serving.session import Session
    from psrl.weights import ParameterStore
    from tests.agents.scripted import ScriptedModel
    from tests.rollout.harness import pool_of

    task = make_task("tool_agent")
    model = ScriptedModel(task.tokenizer, [CALL, "5"])
    store = ParameterStore(keep=4)
    store.publish(0, {"v": 0})
    pool = pool_of([model], store)

    async def run():
        pool.start()
        await pool.ready()
        prompt = task.sample_prompt(random.Random(0))
        session = Session(pool, 0, prompt.ids)

        async def generate(context, budget):
            seg = await session.generate(context, budget)
            if model.version == 0:
                store.publish(1, {"v": 1})
                pool.notify_published()
                await pool.wait_version_above(0)
            return seg

        try:
            ep = await task.run_episode(prompt, generate, random.Random(0))
            return ep, session
        finally:
            await task.close()
            await pool.stop()

    agent_fns.SEEN.clear()
    ep, session = asyncio.run(run())
    assert session.v_traj == 0 and segment_versions(ep.token_versions) == [0, 1]
    partial = session.partial_episode()  # what the proactive truncate would complete it with
    assert partial.response_ids == ep.response_ids and partial.prompt_ids == ep.prompt_ids


def test_cancelling_an_episode_ends_its_turn_in_flight_and_closes_its_url(make_task):
    """What the proactive filter's retry / truncate do to an agent episode: the member is cancelled, so the
    agent is, the engine request of the turn in flight is cancelled too (it runs in the endpoint's handler), and
    the trajectory's URL refuses further requests."""
    import httpx

    from psrl.tasks.agent.endpoint import MODEL

    task = make_task("tool_agent")
    entered, cancelled = asyncio.Event(), []

    async def generate(context, budget):
        entered.set()
        try:
            await asyncio.Event().wait()  # a turn that is still sampling
        except asyncio.CancelledError:
            cancelled.append(len(context))
            raise

    async def run():
        prompt = task.sample_prompt(random.Random(0))
        episode = asyncio.create_task(task.run_episode(prompt, generate, random.Random(0)))
        await entered.wait()
        (uid,) = task.endpoint.conversations
        url = task.endpoint.base_url(uid)
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{url}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            )
        await task.close()
        return r

    r = asyncio.run(run())
    assert cancelled and r.status_code == 404 and "is finished" in r.json()["error"]["message"]
