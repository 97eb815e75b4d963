"""The default ``psrl train``'s seconds per step, this checkout against another commit, measured back to back
(issue #33: "the default psrl train's median time/step_s over 3 seeds is <= 1.05x today's").

The other commit is checked out into a temporary git worktree and run with the same Python environment
(``PYTHONPATH`` pointing at its ``src``); runs alternate (base seed 0, this seed 0, base seed 1, ...) so a change in
the machine's load hits both sides alike. Per run: the median ``time/step_s`` of its rows (the warm start is not a
step); per side: the median over seeds. Ends with one JSON line holding the per-run figures and ``ratio`` (this
checkout over the base).

    python benchmarks/step_time_vs.py --base 06d8d00 --seeds 0,1,2 trainer.total_steps=40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(src: Path, seed: int, overrides: list[str], out: Path) -> float:
    """One ``psrl train`` of the tree at ``src``; the median ``time/step_s`` of its rows."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "psrl.cli", "train", f"trainer.seed={seed}", f"trainer.run_dir={out}", *overrides]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["time/step_s"] for r in rows if "time/step_s" in r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (e.g. the last landed main)")
    p.add_argument("--seeds", default="0,1,2")
    ns, overrides = p.parse_known_args(argv)
    seeds = [int(s) for s in ns.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="psrl-stepvs-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), ns.base], check=True)
        try:
            figures: dict[str, list[float]] = {"base": [], "this": []}
            for seed in seeds:
                for side, src in (("base", base / "src"), ("this", ROOT / "src")):
                    s = run(src, seed, overrides, Path(tmp) / f"{side}-{seed}")
                    figures[side].append(s)
                    print(f"  {side} seed {seed}: median time/step_s {s:.3f}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    med = {k: statistics.median(v) for k, v in figures.items()}
    out = {"base": ns.base, "seeds": seeds, "overrides": overrides, "per_seed": figures, "median": med}
    out["ratio"] = med["this"] / med["base"]
    print(f"median time/step_s: this {med['this']:.3f} vs base {med['base']:.3f} = {out['ratio']:.3f}x")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
