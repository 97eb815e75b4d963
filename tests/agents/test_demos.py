"""An agent task's warm-start demonstrations are the trajectories the endpoint would capture."""

import random

import pytest

from psrl.errors import ConfigError
from psrl.tasks import get_task
from tests.agents.conftest import agent_config, play_scripted

EXAMPLE = "examples/agent_calculator/agent.py"
ROW = {"prompt": [{"role": "user", "content": "What is 37 * 12?"}], "reward_model": {"ground_truth": "444"}}


def example_task(tmp_path, *overrides):
    cfg = agent_config(
        tmp_path, f"{EXAMPLE}:agent", f"task.demonstration={EXAMPLE}:demonstration", *overrides, rows_=[ROW]
    )
    return get_task(cfg.task, seed=0, data=cfg.data)


def test_a_demonstration_is_the_trajectory_its_turns_would_capture(tmp_path):
    """The example's demonstration (call the calculator, answer its result), tokenised for the warm start, equals
    what the endpoint captures when the model samples exactly those turns: the same prompt (the agent's first
    request, tools rendered by psrl's Hermes template), the same response ids, loss mask 1 on the sampled turns
    and 0 on the tool result between them."""
    task = example_task(tmp_path)
    [(prompt_ids, response_ids, mask)] = task.demonstrations(1, random.Random(0))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n</tool_call>'
    ep, reward = play_scripted(task, [call, "444"])
    assert reward["score"] == 1.0 and reward["tool_calls"] == 1.0
    assert prompt_ids == ep.prompt_ids
    assert response_ids == ep.response_ids
    assert mask == ep.loss_mask
    assert 0 < sum(mask) < len(mask)
    assert "<tool_response>\n444\n</tool_response>" in task.tokenizer.decode(
        [t for t, m in zip(response_ids, mask) if not m]
    )


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        ("no_turn_demo", "has no assistant message"),
        ("bad_call_demo", None),
    ],
)
def test_a_demonstration_the_endpoint_would_not_capture_so_is_refused(tmp_path, fn, says):
    """A demonstration without an assistant turn, or whose turn would not parse back into the same message (a
    call whose arguments are not JSON stays content for the hermes parser), fails naming the key; a task without
    ``task.demonstration`` refuses a warm start instead of teaching a bare answer."""
    demo = tmp_path / "demo.py"
    demo.write_text(
        "def no_turn_demo(row):\n    return {'messages': list(row['prompt'])}\n\n"
        "def bad_call_demo(row):\n    return {'messages': list(row['prompt']) + "
        "[{'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'c', 'type': 'function', "
        "'function': {'name': 'calculator', 'arguments': 'not json'}}]}]}\n"
    )
    cfg = agent_config(tmp_path, f"{EXAMPLE}:agent", f"task.demonstration={demo}:{fn}", rows_=[ROW])
    task = get_task(cfg.task, seed=0, data=cfg.data)
    with pytest.raises(ConfigError) as e:
        task.demonstrations(1, random.Random(0))
    assert e.value.key == "task.demonstration"
    assert (says or "does not read back as the same message") in str(e.value)

    plain = get_task(agent_config(tmp_path, f"{EXAMPLE}:agent", rows_=[ROW]).task, seed=0, data=cfg.data)
    with pytest.raises(ConfigError, match="trainer.warm_start_steps=0"):
        plain.demonstrations(1, random.Random(0))
