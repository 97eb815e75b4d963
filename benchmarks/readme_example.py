"""The README's example output and timeline picture, from a real run of the default command (issue #34).

Runs ``psrl train`` as a user does after the set-up -- no arguments: the preset, seed 0 -- in a scratch
directory, so that its run directory is the default ``runs/<time>``. Puts the first two lines of its output,
``...`` and its last three lines between the README's example markers, draws the run with ``psrl viz`` and
copies its timeline to the README's picture. Ends with one JSON line: what the run's last line reports (steps,
reward of the first -> last 10 steps, max staleness and bound) and the wall seconds of the whole command.

    nice -n 10 .venv/bin/python benchmarks/readme_example.py [--readme README.md] [--image PNG] [key=value ...]

Overrides are for the smoke test only: the README's example is the command with none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- written from a real run by `nice -n 10 .venv/bin/python benchmarks/readme_example.py`; not by hand -->"
END = "<!-- end of the example -->"
DONE = re.compile(
    r"^done: (?P<steps>\d+) steps in [\d.]+s, reward (?P<first>[\d.]+) -> (?P<last>[\d.]+) .*"
    r"max staleness (?P<max_staleness>\d+) \(bound (?P<bound>\d+)\); run dir (?P<run_dir>\S+)$"
)
"""``psrl train``'s last line (``psrl.runtime.local.train``)."""


def excerpt(lines: list[str], head: int = 2, tail: int = 3) -> list[str]:
    """The first ``head`` lines (warm start, the run's shape), ``...``, the last ``tail`` (ending with ``done:``)."""
    if len(lines) <= head + tail:
        return list(lines)
    return lines[:head] + ["..."] + lines[-tail:]


def _span(text: str) -> tuple[int, int]:
    """Character offsets of what lies between the markers (after BEGIN's line, up to END's line)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no example markers ({BEGIN!r} ... {END!r})")
    return start + len(BEGIN) + 1, end


def read_example(text: str) -> list[str]:
    """The lines of the example block (inside its code fence)."""
    a, b = _span(text)
    block = text[a:b].splitlines()
    if len(block) < 2 or not block[0].startswith("```") or block[-1] != "```":
        raise ValueError("the example markers must hold exactly one fenced code block")
    return block[1:-1]


def replace_example(text: str, lines: list[str]) -> str:
    """``text`` with the example block holding ``lines``."""
    a, b = _span(text)
    return text[:a] + "```\n" + "".join(line + "\n" for line in lines) + "```\n" + text[b:]


def parse_done(line: str) -> dict:
    """The numbers of ``psrl train``'s last line; ValueError when ``line`` is not one."""
    m = DONE.match(line)
    if not m:
        raise ValueError(f"not psrl train's last line: {line!r}")
    d = m.groupdict()
    return {k: (v if k == "run_dir" else float(v) if "." in v else int(v)) for k, v in d.items()}


def run_psrl(args: list[str], cwd: Path) -> list[str]:
    """``psrl <args>`` from this checkout, in ``cwd``; its output lines (stdout and stderr, as a terminal shows
    them). Raises with the output's tail when it fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "psrl.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    text = out.stdout.decode()
    if out.returncode != 0:
        raise SystemExit(f"psrl {' '.join(args)} exited {out.returncode}:\n{text[-3000:]}")
    return text.splitlines()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--image", type=Path, default=ROOT / "docs" / "img" / "timeline_default.png")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    readme = args.readme.read_text()
    _span(readme)  # markers present: fail before a run of minutes, not after
    with tempfile.TemporaryDirectory(prefix="readme_example-") as tmp:
        t0 = time.perf_counter()
        lines = run_psrl(["train", *args.overrides], Path(tmp))
        wall = time.perf_counter() - t0
        for line in lines:
            print(line)
        done = parse_done(lines[-1])
        run_psrl(["viz", done["run_dir"]], Path(tmp))
        shutil.copyfile(Path(tmp) / done["run_dir"] / "timeline.png", args.image)
    args.readme.write_text(replace_example(readme, excerpt(lines)))
    result = {"command": " ".join(["psrl train", *args.overrides]), **done, "wall_s": round(wall, 1)}
    result.pop("run_dir")
    print(f"wrote the example of {args.readme} and {args.image}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
