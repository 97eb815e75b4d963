"""A synchronous run at a fixed seed does not care how busy the machine is (issue 34).

``psrl train psrl.staleness=0 trainer.total_steps=20`` twice per seed, the second beside a CPU-bound process: the
same ``reward/*`` rows and the same trajectories (every record of ``trajectories.jsonl``, its token ids
included, all but the timing: wall seconds and which instance served it). What makes it so: every trajectory
samples from its own stream (``GenRequest.seed``), so the engine's batching (thread timing) does not reach the
tokens, and the trainer sees each batch in reservation order (``psrl.runtime.coordinator.canonical_order``),
not in the order the groups happened to complete.
Before, the rows parted from step 2 on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _train(run_dir: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """``psrl train`` at staleness 0 for 20 steps: (its ``reward/*`` rows, its trajectory records)."""
    cmd = [sys.executable, "-m", "psrl.cli", "train", "psrl.staleness=0", "trainer.total_steps=20"]
    cmd += [f"trainer.seed={seed}", f"trainer.run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("reward/")} for r in rows], [_fate(t) for t in trajs]


TIMING = ("gen_seconds", "instances")
"""What a record says of timing, which differs by design: wall seconds, and the instance that served it (the
router balances live load); the tokens must not depend on it."""


def _fate(rec: dict) -> dict:
    """A trajectory record without its timing."""
    return {k: v for k, v in rec.items() if k not in TIMING}


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_synchronous_run_samples_and_trains_the_same_beside_a_cpu_hog(tmp_path, seed):
    """Alone, then beside a busy loop in another process: identical reward rows and trajectory records."""
    rows, trajs = _train(tmp_path / "alone", seed)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy_rows, busy_trajs = _train(tmp_path / "busy", seed)
        assert hog.poll() is None, "the CPU hog stopped before the run ended"
    finally:
        hog.kill()
        hog.wait()
    assert len(rows) == 20 and all(t["response_ids"] for t in trajs)
    assert busy_rows == rows
    assert busy_trajs == trajs
