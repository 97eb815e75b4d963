"""``task.agent_history``: a chat template that drops reasoning from history, refused (``error``) or trained as
several sequences of one trajectory (``split``).

The template (``think.jinja``, as DeepSeek-R1's and Qwen3's) opens ``<think>`` in the generation prompt and
renders an earlier assistant turn without it, so every request after the first renders a history that does not
extend the tokens sampled. The scripted model answers turn ``k`` with ``r{k}</think>a{k}`` (the ``<think>\\n`` of
its script is the generation prompt's: the model continues after it).
"""

import asyncio
import json
import random
from pathlib import Path

import openai
import pytest

from psrl.metrics import checked
from psrl.rollout.engines.base import turns
from psrl.runtime.recorder import read_jsonl
from psrl.tasks import get_task
from psrl.train_cli import main
from psrl.types import segment_versions
from tests.agents import agent_fns
from tests.agents.conftest import CALL, agent_config, scripted_engine
from tests.agents.test_agent_runs import RUN
from tests.rollout.harness import check_bound

THINK = str(Path(__file__).with_name("think.jinja"))
OPENER = "<think>\n"


def think_task(tmp_path, history, n_turns):
    row = {"prompt": [{"role": "user", "content": "Q?"}], "reward_model": {"ground_truth": "x"}}
    row["extra_info"] = {"turns": n_turns}
    cfg = agent_config(
        tmp_path,
        "follow_up_agent",
        f"task.chat_template={THINK}",
        f"task.agent_history={history}",
        rows_=[row],
    )
    return get_task(cfg.task, seed=0, data=cfg.data)


def script(n_turns):
    return [f"{OPENER}r{k}</think>a{k}" for k in range(n_turns)]


def play_recording(task, engine, model=None):
    """One episode; the episode and every engine request's context (what each ``generate`` call was given).
    With ``model``, its version goes up by one after every turn (a weight update between turns)."""
    inner, contexts = turns(engine), []

    async def generate(context, budget):
        contexts.append(list(context))
        seg = await inner(context, budget)
        if model is not None:
            model.version += 1
        return seg

    async def run():
        try:
            prompt = task.sample_prompt(random.Random(0))
            return await task.run_episode(prompt, generate, random.Random(0))
        finally:
            await task.close()
            await engine.close()

    agent_fns.SEEN.clear()
    return asyncio.run(run()), contexts


def test_under_error_a_template_that_drops_reasoning_fails_the_request_naming_the_key(tmp_path):
    task = think_task(tmp_path, "error", 2)
    _, engine = scripted_engine(task, script(2))
    with pytest.raises(openai.BadRequestError) as err:
        play_recording(task, engine)
    assert err.value.code == "history_mismatch" and "task.agent_history=split" in str(err.value)


@pytest.mark.parametrize("n_turns", [1, 2, 3, 4])
def test_under_split_each_rewrite_starts_a_sequence_that_is_exactly_what_the_engine_saw_and_sampled(tmp_path, n_turns):
    """``n_turns`` turns, ``n_turns - 1`` rewrites, ``n_turns`` sequences (one turn each): sequence ``k``'s prompt
    is the context of the ``k``-th engine request and its trained tokens the ones sampled for it (by the engine's
    own record), each with its log-prob and version; the log-probs the agent got count the loss mask, sequence by
    sequence; the sequences concatenate to everything sampled."""
    task = think_task(tmp_path, "split", n_turns)
    model, engine = scripted_engine(task, script(n_turns))
    ep, contexts = play_recording(task, engine, model)
    seqs = [*ep.earlier, ep]  # an Episode holds its last sequence itself, as a Trajectory does
    assert len(seqs) == n_turns == len(contexts) == len(agent_fns.SEEN) and ep.turns == n_turns
    prompts = [*(s.prompt_ids for s in ep.earlier), ep.prompt_ids]
    sampled = [t for call in model.sampled for t in call]
    at = 0
    for k, (seq, prompt, context, reply) in enumerate(zip(seqs, prompts, contexts, agent_fns.SEEN)):
        trained = [t for t, m in zip(seq.response_ids, seq.loss_mask) if m]
        assert prompt == context and seq.response_ids == trained  # no tool turns here: all of it is sampled
        assert trained == task.tokenizer.encode(f"r{k}</think>a{k}") + [task.tokenizer.eos_id]
        assert trained == sampled[at : at + len(trained)]
        at += len(trained)
        assert len(reply.choices[0].logprobs.content) == sum(seq.loss_mask) == len(seq.logprobs)
        assert seq.logprobs == [pytest.approx(-(k + 1) / 10)] * len(trained)
        assert segment_versions(seq.token_versions) == [k]
    assert at == len(sampled)
    if n_turns > 1:  # what split costs: the new prompt is prefilled again, and it is not the old tokens extended
        stored = contexts[0] + seqs[0].response_ids
        assert contexts[1][: len(stored)] != stored and len(contexts[1]) > len(stored) - len(OPENER)


def test_split_does_not_split_a_history_that_extends(make_task):
    """The tool round trip of test_capture under ``split``: the history extends, so one sequence, as under
    ``error``."""
    task = make_task("tool_agent", "task.agent_history=split")
    _, engine = scripted_engine(task, [CALL, "5"])
    ep, _ = play_recording(task, engine)
    assert ep.earlier == [] and ep.turns == 2 and 0 in ep.loss_mask


def test_a_template_that_only_strips_reasoning_from_earlier_content_still_extends(tmp_path):
    """The reasoning template with a plain generation prompt: recognised turns go back as their stored tokens
    (reasoning included), so stripping ``<think>`` text from earlier assistant content rewrites nothing -- one
    sequence, and under ``error`` no error; what splits above is the ``<think>`` the generation prompt opened."""
    plain = tmp_path / "strip.jinja"
    plain.write_text(Path(THINK).read_text().replace("assistant\\n<think>\\n", "assistant\\n"))
    assert "<think>\\n' }}" not in plain.read_text()
    row = {"prompt": [{"role": "user", "content": "Q?"}], "reward_model": {"ground_truth": "x"}}
    cfg = agent_config(tmp_path, "follow_up_agent", f"task.chat_template={plain}", rows_=[row])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    _, engine = scripted_engine(task, [f"r{k}</think>a{k}" for k in range(2)])
    ep, _ = play_recording(task, engine)
    assert ep.earlier == [] and ep.turns == 2
    assert "r0</think>a0" in task.tokenizer.decode(ep.response_ids)  # the first turn's reasoning stays in context


def test_the_trajectory_keeps_one_v_traj_and_its_oldest_token_leads_the_segment_versions(tmp_path):
    """One trajectory for the staleness protocol: ``V_traj`` is the first sequence's, ``segment_versions`` run over
    every sequence in order (so the audit's ``min(segment_versions) >= V_traj`` checks the oldest token), and each
    row the trainer gets is one sequence with the trajectory's identity and reward."""
    from psrl.rollout.client.records import trajectory_record
    from psrl.tasks.base import Prompt, episode_to_trajectory

    task = think_task(tmp_path, "split", 3)
    model, engine = scripted_engine(task, script(3))
    ep, _ = play_recording(task, engine, model)
    traj = episode_to_trajectory(Prompt("p", [1], "x"), ep, {"score": 0.5}, uid="t", group="g", v_traj=0)
    assert traj.segment_versions == [0, 1, 2] and traj.prompt_ids == ep.prompt_ids
    rows = traj.rows()
    assert [r.prompt_ids for r in rows] == [s.prompt_ids for s in ep.earlier] + [ep.prompt_ids]
    assert [r.loss_mask for r in rows] == [s.loss_mask for s in ep.earlier] + [ep.loss_mask]
    assert all((r.uid, r.group, r.v_traj, r.reward, r.earlier) == ("t", "g", 0, 0.5, ()) for r in rows)
    rec = trajectory_record(traj, "trained", consumed_version=1)
    assert rec["sequences"] == 3 and rec["earlier_response_ids"] == [s.response_ids for s in ep.earlier]
    assert rec["segment_versions"] == [0, 1, 2] and rec["response_ids"] == ep.response_ids


def test_the_session_splits_its_running_record_as_the_capture_does(tmp_path):
    """On the real rollout instance: the session's own record (what the proactive ``truncate`` completes a
    trajectory with) holds the same sequences as the episode, instead of keeping the rewritten tokens as context."""
    from psrl.rollout.serving.session import Session
    from psrl.weights import ParameterStore
    from tests.agents.scripted import ScriptedModel
    from tests.rollout.harness import pool_of

    task = think_task(tmp_path, "split", 3)
    model = ScriptedModel(task.tokenizer, script(3))
    store = ParameterStore(keep=2)
    store.publish(0, {"v": 0})
    pool = pool_of([model], store)

    async def run():
        pool.start()
        await pool.ready()
        prompt = task.sample_prompt(random.Random(0))
        session = Session(pool, 0, prompt.ids)
        try:
            return await task.run_episode(prompt, session.generate, random.Random(0)), session
        finally:
            await task.close()
            await pool.stop()

    agent_fns.SEEN.clear()
    ep, session = asyncio.run(run())
    partial = session.partial_episode()
    assert len(ep.earlier) == 2 and partial.earlier == ep.earlier
    assert (partial.prompt_ids, partial.response_ids, partial.loss_mask) == (
        ep.prompt_ids,
        ep.response_ids,
        ep.loss_mask,
    )


def test_a_split_run_trains_every_sequence_and_audits_one_trajectory_each(tmp_path):
    """``psrl train`` on the built-in model with the reasoning template and ``split``: each trajectory of two
    turns is two sequences (``batch/sequences`` twice ``batch/trajectories``), trained as rows by the real trainer;
    the records count trajectories (one each, ``sequences`` 2) and keep the bound."""
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(4)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    args = [
        "task.name=agent",
        "task.agent=tests.agents.agent_fns:follow_up_agent",
        f"task.chat_template={THINK}",
        "task.agent_history=split",
        f"data.train_files={data}",
        "data.max_prompt_length=200",
        "model.n_positions=256",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(RUN + args) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(checked(m) for m in metrics)
    assert all(m["batch/sequences"] == 2 * m["batch/trajectories"] == 2 * 2 * 2 for m in metrics)
    trained = [r for r in read_jsonl(run_dir / "trajectories.jsonl") if r["status"] == "trained"]
    assert check_bound(trained, 1) == 3 * 2 * 2  # steps x groups x N: one record per trajectory
    assert all(r["sequences"] == 2 and len(r["earlier_response_ids"]) == 1 for r in trained)
