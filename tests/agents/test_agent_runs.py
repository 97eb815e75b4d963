"""``psrl train task.name=agent`` end to end on the built-in model, and the shipped example agent."""

import json

from psrl.metrics import checked
from psrl.runtime.recorder import read_jsonl
from psrl.tasks import get_task
from psrl.train_cli import main
from tests.agents.conftest import agent_config, play_scripted

RUN = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "psrl.rollout_n=2",
    "psrl.staleness=1",
    "psrl.staleness_buffer_entries=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
    "data.max_response_length=8",
    "task.reward_retries=1",
    "trainer.total_steps=3",
]


def test_an_agent_run_trains_within_the_bound_and_records_failing_episodes(tmp_path):
    """Every step trains; trained trajectories keep the bound and their prompt is the agent's first request; an
    agent that raises on a row is retried, then recorded ``error`` with its message, and the run goes on."""
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(6)
    ]
    rows[2]["extra_info"] = {"fail": True}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    args = [
        "task.name=agent",
        "task.agent=tests.agents.agent_fns:fails_on_marked_rows",
        f"data.train_files={data}",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(RUN + args) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(checked(m) for m in metrics)
    assert all(m["batch/tool_call_frac"] == 0.0 and m["reward/mean"] == 1.0 for m in metrics)
    records = read_jsonl(run_dir / "trajectories.jsonl")
    trained = [r for r in records if r["status"] == "trained"]
    assert len(trained) == 3 * 2 * 2
    assert all(0 <= r["consumed_version"] - r["v_traj"] <= 1 for r in trained)
    errors = [r for r in records if r["status"] == "error"]
    assert errors and all("agent bug on a marked row" in r["error"] for r in errors)


def test_the_example_agent_calls_its_calculator_and_scores_the_answer(tmp_path):
    """examples/agent_calculator/agent.py (openai only) on a model scripted to call the tool and copy its result."""
    row = {"prompt": [{"role": "user", "content": "What is 37 * 12?"}], "reward_model": {"ground_truth": "444"}}
    cfg = agent_config(tmp_path, "examples/agent_calculator/agent.py:agent", rows_=[row])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n</tool_call>'
    ep, reward = play_scripted(task, [call, "It is 444."])
    assert reward["score"] == 1.0 and reward["good_calls"] == 1.0 and reward["tool_calls"] == 1.0
    assert "444" in task.tokenizer.decode(ep.response_ids)


def test_psrl_train_closes_the_agent_endpoint_on_its_own_loop(tmp_path):
    """The run's end stops the task's endpoint and HTTP pool before the loop closes: a second run in the same
    process (the learning benchmark's seeds) met the first run's pool, closed on a dead loop."""
    import asyncio

    from psrl.config import load_config
    from psrl.runtime.local import train

    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["task.name=agent", "task.agent=tests.agents.agent_fns:fails_on_marked_rows", f"data.train_files={data}"]
    cfg = load_config(None, RUN + args + ["trainer.total_steps=1"])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    asyncio.run(train(cfg, tmp_path / "run", log=lambda _: None, task=task))
    assert task.endpoint is None and task._http is None
