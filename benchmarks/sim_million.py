"""How long a million-trajectory simulation takes: the budget is one minute on one core.

    .venv/bin/python benchmarks/sim_million.py [--policies psrl,areal] [--steps 250]

Workload: 250 steps of 512 groups x 8 (1,024,000 trained trajectories), 4096 slots, lognormal
sigma 1.0, capacity-balanced (train_time = mean generation time), eta = 2. ``psrl`` runs the real
StalenessManager; the peers run on the same engine. Prints, per policy, wall seconds, trajectories
per second and the share of the 60 s budget, side by side, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from psrl.sim import simulate
from psrl.sim.workload import Workload

BUDGET_S = 60.0


def million_workload(steps: int = 250) -> Workload:
    return Workload(
        slots=4096,
        steps=steps,
        staleness=2,
        batch_size=512,
        redundant_batch_size=512,
        group_size=8,
        redundant_group_size=8,
        sigma=1.0,
        train_time=math.exp(0.5),
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="psrl")
    ap.add_argument("--steps", type=int, default=250)
    ns = ap.parse_args(argv)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass
    wl = million_workload(ns.steps)
    rows = []
    print(
        f"{'policy':<16} {'launched':>10} {'trained':>10} {'wall_s':>7} {'traj/s':>9} {'of 60 s':>8}  ratio  violations"
    )
    for policy in [p.strip() for p in ns.policies.split(",") if p.strip()]:
        t0 = time.perf_counter()
        r = simulate(wl, policy)
        dt = time.perf_counter() - t0
        rows.append(
            {
                "policy": policy,
                "launched": r.launched_trajectories,
                "trained": r.trained_trajectories,
                "wall_seconds": round(dt, 2),
                "trajectories_per_second": round(r.launched_trajectories / dt),
                "budget_fraction": round(dt / BUDGET_S, 3),
                "ratio_to_ideal": round(r.ratio_to_ideal, 4),
                "violations": r.violations,
            }
        )
        print(
            f"{policy:<16} {r.launched_trajectories:>10} {r.trained_trajectories:>10} {dt:>7.1f} "
            f"{r.launched_trajectories / dt:>9.0f} {dt / BUDGET_S:>8.2f}  {r.ratio_to_ideal:.3f}  {r.violations}"
        )
    print(
        json.dumps(
            {
                "benchmark": "sim_million",
                "budget_seconds": BUDGET_S,
                "steps": ns.steps,
                "within_budget": all(r["wall_seconds"] < BUDGET_S for r in rows),
                "runs": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
