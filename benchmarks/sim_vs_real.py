"""Does the simulator predict a real ``psrl train`` run? Replay its timings, compare seconds per step.

    .venv/bin/python benchmarks/sim_vs_real.py RUN_DIR [RUN_DIR ...] [--tolerance 0.15] [--policy coordinator]

For each run directory (``config.yaml``, ``trajectories.jsonl``, ``metrics.jsonl``) the workload is
the run's own config with

* ``sim.gen_time.dist=trace`` on its ``trajectories.jsonl`` (the measured ``gen_seconds`` replayed
  in order; the training step time is the mean ``time/train_s`` of its ``metrics.jsonl``),
* ``sim.slots`` = ``psrl.deployment.n_rollout_instances x psrl.routing_strategy.max_concurrent_seqs_per_instance`` (agent workers),
* ``sim.steps`` = the steps the run recorded,

(:mod:`psrl.sim.replay`, shared with ``psrl simulate --recommend``, which also says how cut-short and
missing generation times are replayed)

and the psrl policy is simulated (``--policy coordinator``: psrl train's real coordinator in virtual
time, one instance with that many workers). Measured seconds per step use the same window as the simulator
(end of warm-up to the last step, from the ``time`` column). Exit status 1 if any run is off by
more than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from psrl.sim import simulate
from psrl.sim.replay import measured_seconds_per_step, replay_workload


def compare_run(run_dir: Path, policy: str = "psrl") -> dict:
    """Predicted (by ``policy``: psrl or coordinator) vs measured seconds per step of one run."""
    measured, steps = measured_seconds_per_step(run_dir)
    wl = replay_workload(run_dir, steps)
    r = simulate(wl, policy)
    return {
        "run": str(run_dir),
        "steps": steps,
        "slots": wl.slots,
        "eta": wl.staleness,
        "mean_gen_s": wl.mean_gen_time(),
        "train_s": wl.train_time,
        "measured_s_per_step": measured,
        "predicted_s_per_step": r.seconds_per_step,
        "error": r.seconds_per_step / measured - 1.0,
        "ideal_s_per_step": 3600.0 / r.ideal_steps_per_hour,
        "predicted_staleness_mean": r.staleness_mean,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories of psrl train")
    ap.add_argument("--tolerance", type=float, default=0.15, help="allowed relative error (default 0.15)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--policy",
        choices=("psrl", "coordinator"),
        default="psrl",
        help="predict with the psrl model (default) or psrl train's real coordinator in virtual time",
    )
    ns = ap.parse_args(argv)
    rows = [compare_run(Path(p), ns.policy) for p in ns.runs]
    if ns.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(
            f"{'run':<40} {'steps':>5} {'slots':>5} {'eta':>3} {'gen_s':>7} {'train_s':>7} "
            f"{'measured':>9} {'predicted':>9} {'error':>7}"
        )
        for r in rows:
            print(
                f"{r['run'][-40:]:<40} {r['steps']:>5} {r['slots']:>5} {r['eta']:>3} {r['mean_gen_s']:>7.3f} "
                f"{r['train_s']:>7.3f} {r['measured_s_per_step']:>9.3f} {r['predicted_s_per_step']:>9.3f} "
                f"{r['error']:>+7.1%}"
            )
    bad = [r for r in rows if abs(r["error"]) > ns.tolerance]
    if bad:
        print(f"{len(bad)} of {len(rows)} runs off by more than {ns.tolerance:.0%}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
