"""Do real ``psrl train`` runs with head-scope truncation realise the simulator's prediction? (3 seeds)

    .venv/bin/python benchmarks/head_scope_real.py [--seeds 1 2 3] [--steps 40] [--out DIR] [--tolerance 0.10]
        [key=value ...]

For each seed, ``psrl train`` runs as users run it (a subprocess of the CLI) on the built-in default with
``psrl.proactive_filter_strategy.method=truncate``, ``scope=head``, ``threshold=1`` (what ``psrl simulate
--recommend`` picked from a 40-step run of this job, docs/simulate.md) plus any ``key=value``; then

* the prediction of ``benchmarks/sim_vs_real.py`` (:func:`sim_vs_real.compare_run`: the run's own generation
  times, step time, slots and steps replayed) with the ``psrl`` model and with ``psrl train``'s real
  coordinator in virtual time (``coordinator``), against the measured seconds per step;
* the staleness audit of its ``trajectories.jsonl``: every trained trajectory has ``consumed_version - v_traj
  <= psrl.staleness`` and segments no older than ``v_traj``; how many were cut (``truncated``).

Prints one line per run, the mean and spread of the errors, and last one JSON line; exit status 1 when a run's
error is past ``--tolerance`` or its audit is not clean. A benchmark, not a test: wall-clock seconds on a
shared CPU move with the load, which the replay sees only through the run's own timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from psrl.runtime.recorder import read_jsonl  # noqa: E402
from sim_vs_real import compare_run  # noqa: E402

HEAD = [
    "psrl.proactive_filter_strategy.method=truncate",
    "psrl.proactive_filter_strategy.scope=head",
    "psrl.proactive_filter_strategy.threshold=1",
]


def audit(run_dir: Path) -> dict:
    """Trained trajectories, violations of the bound (uids), truncated ones, statuses."""
    eta = int(yaml.safe_load((run_dir / "config.yaml").read_text())["psrl"]["staleness"])
    recs = read_jsonl(run_dir / "trajectories.jsonl")
    trained = [r for r in recs if r.get("status") == "trained"]
    bad = [
        r["uid"]
        for r in trained
        if r["consumed_version"] - r["v_traj"] > eta or min(r.get("segment_versions") or [r["v_traj"]]) < r["v_traj"]
    ]
    return {
        "eta": eta,
        "trained": len(trained),
        "violations": bad,
        "truncated": sum(1 for r in trained if r.get("truncated")),
        "max_staleness": max((r["consumed_version"] - r["v_traj"] for r in trained), default=0),
    }


def run(seed: int, steps: int, root: Path, overrides: list[str]) -> Path:
    run_dir = root / f"head-seed{seed}"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from psrl.cli import main; sys.exit(main())",
        "train",
        *HEAD,
        f"trainer.total_steps={steps}",
        f"trainer.seed={seed}",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    with open(root / f"head-seed{seed}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--results", type=Path, default=None, help="store the per-run figures and the command here")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides for every run")
    ns = ap.parse_args(argv)
    root = ns.out or Path(tempfile.mkdtemp(prefix="head-scope-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    for seed in ns.seeds:
        run_dir = root / f"head-seed{seed}"
        if not (run_dir / "metrics.jsonl").exists():
            run_dir = run(seed, ns.steps, root, ns.overrides)
        model, real = compare_run(run_dir, "psrl"), compare_run(run_dir, "coordinator")
        a = audit(run_dir)
        rows.append(
            {
                "seed": seed,
                "measured_s_per_step": model["measured_s_per_step"],
                "predicted_s_per_step": model["predicted_s_per_step"],
                "error": model["error"],
                "coordinator_predicted_s_per_step": real["predicted_s_per_step"],
                "coordinator_error": real["error"],
                "train_s": model["train_s"],
                **{k: a[k] for k in ("trained", "truncated", "max_staleness", "eta")},
                "violations": len(a["violations"]),
            }
        )
        r = rows[-1]
        print(
            f"seed {seed}: measured {r['measured_s_per_step']:.3f} s/step, psrl model {r['predicted_s_per_step']:.3f} "
            f"({r['error']:+.1%}), real coordinator {r['coordinator_predicted_s_per_step']:.3f} "
            f"({r['coordinator_error']:+.1%}); audit: {r['trained']} trained, {r['truncated']} truncated, max "
            f"staleness {r['max_staleness']} (bound {r['eta']}), {r['violations']} violations",
            flush=True,
        )

    def spread(key: str) -> dict:
        xs = [r[key] for r in rows]
        return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "min": min(xs), "max": max(xs)}

    err, cerr = spread("error"), spread("coordinator_error")
    worst = max(max(abs(r["error"]), abs(r["coordinator_error"])) for r in rows)
    clean = all(r["violations"] == 0 and r["max_staleness"] <= r["eta"] for r in rows)
    print(
        f"{len(rows)} runs ({time.perf_counter() - started:.0f}s): error of the psrl model "
        f"{err['mean']:+.1%} +- {err['std']:.1%}, of the real coordinator "
        f"{cerr['mean']:+.1%} +- {cerr['std']:.1%}; worst {worst:.1%} "
        f"(tolerance {ns.tolerance:.0%}); audit {'clean' if clean else 'NOT clean'}  (runs: {root})"
    )
    summary = {
        "seeds": ns.seeds,
        "steps": ns.steps,
        "config": HEAD + ns.overrides,
        "runs": rows,
        "error": err,
        "coordinator_error": cerr,
        "worst_abs_error": worst,
        "tolerance": ns.tolerance,
        "audit_clean": clean,
        "seconds": time.perf_counter() - started,
    }
    if ns.results:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import results as stored

        stored.write(ns.results, summary)
    print(json.dumps(summary))
    return 0 if worst <= ns.tolerance and clean else 1


if __name__ == "__main__":
    sys.exit(main())
