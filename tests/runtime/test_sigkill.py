"""SIGKILL of ``psrl train`` at a random step, then the same command: nothing recorded twice, audit clean.

A real ``psrl train`` process (tiny model, agentic task) is killed with SIGKILL once ``metrics.jsonl`` holds a
randomly chosen step -- possibly in the middle of writing a checkpoint or a log line -- and the same command
is run again. The run must finish with every step once in ``metrics.jsonl``, every trajectory once in
``trajectories.jsonl`` (each completed one accounted for: trained, dropped with a status, or held), every
buffer event once in ``events.jsonl`` with no half line, and every trained trajectory within the bound.
The kill waits for an event (the step's line), bounded; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from psrl.runtime.recorder import read_jsonl
from tests.rollout.harness import check_bound
from tests.runtime.test_train_cli_e2e import TINY

SRC = Path(__file__).resolve().parents[2] / "src"
TOTAL = 8


def _cmd(run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "psrl.cli",
        "train",
        *TINY,
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={TOTAL}",
        "psrl.staleness=1",
    ]


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def _steps(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_the_same_command_records_nothing_twice(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    kill_at = random.Random(seed).randint(1, TOTAL - 2)
    why = f"(seed {seed}: killed after step {kill_at})"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(run_dir), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while _steps(run_dir / "metrics.jsonl") < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # polling for the step's line (an event), bounded by the deadline
    assert proc.poll() is None, f"the run ended before step {kill_at} {why}: {proc.stdout.read().decode()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)

    again = subprocess.run(_cmd(run_dir), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, f"{why}\n{again.stdout[-2000:]}\n{again.stderr[-2000:]}"

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1)), why
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    twice = [u for u, n in Counter(t["uid"] for t in trajs).items() if n > 1]
    assert not twice, f"{why} recorded twice: {twice[:5]}"
    assert check_bound(trajs, 1) == TOTAL * 2 * 2, why
    completed = [t for t in trajs if t["status"] != "error"]
    assert len(completed) == rows[-1]["counts/generated"], f"{why}: a completed trajectory has no record"
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]  # raises on a half line
    dup = [k for k, n in Counter((e["kind"], str(e["entry"])) for e in events).items() if n > 1]
    assert not dup, f"{why} events recorded twice: {dup[:5]}"
    assert sum(e["kind"] == "consume" for e in events) == TOTAL * 2, why
