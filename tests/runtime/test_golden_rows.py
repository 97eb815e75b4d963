"""Behaviour pinned across restructurings: a short run in virtual time writes the same rows as it did before.

The rows in ``golden/`` were recorded on the commit before the code was re-shaped into packages (issue 21) with
``PSRL_GOLDEN_RECORD=1 python -m pytest tests/runtime/test_golden_rows.py``. A change that alters what a run does
(a metric, a trajectory's fate, a version) fails here; a change that only moves code does not. Re-record only for
a change of behaviour that is meant, and say so in its commit.

The run is the real coordinator, built by ``psrl.runtime.local.build``, on fake engines, task and trainer, on the
virtual-time loop with fixed seeds, so every number is deterministic: heavy-tailed tool latency, and each variant
switching on a different part of the rollout side (partial rollout and migration, redundancy, the proactive
filter, request-count sync and interrupt-as-prompt).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest

from psrl.rollout.client.records import MemorySink
from psrl.rollout.fakes import FakeTask
from tests.rollout.harness import config, coordinator, run

GOLDEN = Path(__file__).parent / "golden"

VARIANTS = {
    "plain": {"psrl__staleness": 2},
    "partial_migration": {
        "psrl__staleness": 2,
        "psrl__partial_rollout__enable": True,
        "psrl__sync_and_mig_strategy__method": "status_based",
        "psrl__sync_and_mig_strategy__sync__threshold": 3,
        "psrl__sync_and_mig_strategy__mig__enable": True,
        "psrl__sync_and_mig_strategy__mig__threshold": 1.5,
        "psrl__sync_and_mig_strategy__mig__stop_threshold": 1.1,
        "psrl__routing_strategy__max_concurrent_seqs_per_instance": 8,
    },
    "redundant": {
        "psrl__staleness": 1,
        "psrl__redundant_rollout__enable": True,
        "psrl__redundant_rollout__redundant_global_batch_size": 3,
        "psrl__redundant_rollout__redundant_rollout_n": 3,
        "psrl__routing_strategy__method": "round_robin",
    },
    "interrupt": {
        "psrl__staleness": 1,
        "psrl__partial_rollout__enable": True,
        "psrl__partial_rollout__interrupt_as_prompt": True,
    },
    "proactive_truncate": {
        "psrl__staleness": 2,
        "psrl__proactive_filter_strategy__method": "truncate",
        "psrl__proactive_filter_strategy__threshold": 1,
    },
    "sync": {"psrl__staleness": 0},
}
STEPS = 6


def heavy_tail(prompt, episode_no, call):
    return random.Random(episode_no * 7919 + call).lognormvariate(0.0, 1.5)


def record(name: str) -> dict:
    sink = MemorySink()
    coord = coordinator(
        config(**VARIANTS[name]), FakeTask(turns=3, turn_tokens=4, latency_fn=heavy_tail), sink=sink, sync_cost=0.2
    )
    run(coord, STEPS)
    return {"metrics": sink.metrics, "trajectories": sorted(sink.trajectories, key=lambda r: (r["uid"], r["status"]))}


def same(a, b, path="") -> None:
    """Equal, floats to 1e-9 relative; the path of the first difference in the message."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), f"{path}: {a!r} != {b!r}"
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b)), (
            f"{path}: {a!r} != {b!r}"
        )
    elif isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_virtual_time_run_writes_the_recorded_rows(name):
    """Every metric row and every trajectory record of the run equals the recording (floats to 1e-9)."""
    got = json.loads(json.dumps(record(name)))  # as JSON would carry it: tuples become lists
    path = GOLDEN / f"{name}.json"
    if os.environ.get("PSRL_GOLDEN_RECORD") == "1":
        path.write_text(json.dumps(got, indent=None, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert len(got["metrics"]) == STEPS
    same(got, want, name)
