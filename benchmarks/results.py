"""Stored results: a benchmark's raw numbers (per run, per seed) under ``docs/results/``, with the command that made them.

Every table of measured numbers in ``docs/`` is rendered from one of these files (``benchmarks/render_docs.py``),
so a reader can re-derive a table, and re-run the command to check it.
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def command_line(argv: list[str] | None = None) -> str:
    """The command as run from the repository root: ``PYTHONPATH=src python benchmarks/X.py ARGS``."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return "PYTHONPATH=src python " + shlex.join([str(shown), *argv[1:]])


def _commit() -> str:
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def write(path: Path, data: dict, command: str | None = None) -> Path:
    """Write ``data`` to ``path`` with the command that made it, the commit and the UTC date."""
    record = {
        "command": command or command_line(),
        "commit": _commit(),
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        **data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def child_run(cmd: list[str], what: str) -> dict:
    """Run a benchmark's child process ``cmd`` and return the JSON of its last stdout line; a child that fails
    shows the end of its stderr and stops the benchmark naming ``what`` ran."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{what}: exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def read(name: str) -> dict:
    """``docs/results/<name>.json``."""
    return json.loads((RESULTS / f"{name}.json").read_text())
