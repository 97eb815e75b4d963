"""An agent task over the built-in character tokenizer (psrl's Hermes template) and a scripted model."""

import asyncio
import json
import random

import pytest
import torch

pytest.importorskip("openai", reason="task.name=agent needs the agents extra: pip install -e '.[agents]'")
pytest.importorskip("starlette", reason="task.name=agent needs the agents extra: pip install -e '.[agents]'")
pytest.importorskip("uvicorn", reason="task.name=agent needs the agents extra: pip install -e '.[agents]'")

from psrl.config import load_config
from psrl.rollout.engines.base import NoCacheEngine, turns
from psrl.tasks import get_task
from psrl.types import Sampling
from tests.agents.scripted import ScriptedModel

torch.set_num_threads(1)

ROWS = [
    {
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "reward_model": {"ground_truth": "5"},
        "data_source": "s",
    },
    {
        "prompt": [{"role": "user", "content": "What is 4+4?"}],
        "reward_model": {"ground_truth": "8"},
        "data_source": "s",
    },
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def agent_config(tmp_path, agent, *overrides, rows_=ROWS):
    """``agent`` a function of tests/agents/agent_fns.py, or ``file.py:function``; ``rows_`` the data."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return load_config(
        None,
        [
            "task.name=agent",
            f"task.agent={agent if ':' in agent else 'tests.agents.agent_fns:' + agent}",
            f"data.train_files={rows}",
            "data.max_prompt_length=900",
            "data.max_response_length=96",
            "model.n_positions=1100",
            "task.reward=exact",
            "task.agent_timeout=20",
            *overrides,
        ],
    )


@pytest.fixture
def make_task(tmp_path):
    made = []

    def make(agent="tool_agent", *overrides):
        cfg = agent_config(tmp_path, agent, *overrides)
        task = get_task(cfg.task, seed=0, data=cfg.data)
        made.append(task)
        return task

    return make


def scripted_engine(task, script, version=0):
    model = ScriptedModel(task.tokenizer, script, version=version)
    return model, NoCacheEngine(model, sampling=Sampling(stop_ids=frozenset(task.stop_ids)))


def play_scripted(task, script):
    """One episode of ``task``'s agent on a model scripted to answer ``script`` turn by turn: the episode and its
    reward (the task and the engine closed after)."""
    _, engine = scripted_engine(task, script)

    async def run():
        try:
            prompt = task.sample_prompt(random.Random(0))
            ep = await task.run_episode(prompt, turns(engine), random.Random(0))
            return ep, await task.reward(prompt, ep)
        finally:
            await task.close()
            await engine.close()

    return asyncio.run(run())
