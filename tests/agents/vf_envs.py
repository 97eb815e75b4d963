"""verifiers environments for tests/agents/test_verifiers.py (``task.verifiers=tests.agents.vf_envs:<name>``)."""

from __future__ import annotations

import threading

from examples.verifiers_tool.env import load_environment

SAID_WEIGHT = 0.01


def said_chars(completion) -> float:
    """Characters of the model's last message: a reward every reply earns a known share of."""
    said = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str)]
    return float(len(said[-1])) if said else 0.0


def calculator_env_scoring_length():
    """The example environment with one more reward function (weight ``SAID_WEIGHT``), so a test can recompute
    every trajectory's reward from the tokens it recorded."""
    env = load_environment(n=32)
    env.rubric.add_reward_func(said_chars, weight=SAID_WEIGHT)
    return env


def not_an_environment():
    return {"dataset": []}


def raises():
    raise RuntimeError("environment build failed")


RELEASE = threading.Event()
"""Set by the test that uses :func:`calculator_env_hanging_reward` to let its reward function return."""


def hangs(completion) -> float:
    """A synchronous reward function that does not return until the test releases it."""
    RELEASE.wait()
    return 0.0


def calculator_env_hanging_reward():
    env = load_environment(n=4)
    env.rubric.add_reward_func(hangs)
    return env
