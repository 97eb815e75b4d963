"""A benchmark script run as a user runs it (from the repository root, ``src`` on the path), for the smoke tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    """Run ``benchmarks/<script>`` with ``args``; assert it exits 0 (showing its output's tails otherwise) and return
    its last stdout line, the one JSON object every benchmark ends with."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
