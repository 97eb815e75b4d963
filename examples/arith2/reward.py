"""The reward of the ``arith2`` dataset: 1.0 when the answer after ``####`` is the ground truth, else 0.0.

A verl reward file: psrl calls it the way verl calls ``custom_reward_function.path``, so
``task.reward=examples/arith2/reward.py:compute_score`` here is ``custom_reward_function.path=...``,
``.name=compute_score`` there. Strict like verl's GSM8K score (``verl/utils/reward_score/gsm8k.py``,
``method="strict"``): only the last ``#### N`` counts (commas dropped; ``85.0`` is not ``85``, a full
stop after the number is not part of it), a reply without one scores 0.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_answer(solution_str: str) -> str | None:
    """The number after the last ``####`` (commas removed), or None when the reply has none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].replace(",", "") if found else None


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    answer = extract_answer(solution_str)
    return float(answer is not None and answer == str(ground_truth).strip())
