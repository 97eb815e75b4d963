"""``benchmarks/smollm2_repro.py`` counts a trajectory identical only when both runs hold it with the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from smollm2_repro import compare  # noqa: E402


def test_a_trajectory_counts_as_identical_only_with_the_same_uid_and_tokens():
    alone = {"g0/0": [1, 2, 3], "g0/1": [4, 5], "g1/0": [6]}
    busy = {"g0/0": [1, 2, 3], "g0/1": [4, 7], "g2/0": [6]}
    # g0/0 matches; g0/1 differs in its second token; g1/0 and g2/0 are each in one run only (same tokens, other uid)
    assert compare(alone, busy) == {"trajectories": 4, "identical": 1, "only_in_one": 2, "tokens": 6}


def test_two_equal_runs_are_wholly_identical():
    run = {f"g{i}/0": [i, i + 1] for i in range(5)}
    assert compare(run, dict(run)) == {"trajectories": 5, "identical": 5, "only_in_one": 0, "tokens": 10}
