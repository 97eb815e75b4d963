"""psrl.adaptive_staleness in the simulator: the controller against the best fixed bound inside the limits.

Over the reference simulated workloads of docs/simulate.md (64 slots, 16 groups x 4, lognormal median 1 s,
sigma 0.5 and 1.0, the four train-time settings of benchmarks/policies.py, 300 steps), for each seed:

* fixed bounds 0..CEILING (the ``psrl`` policy): steps/h and the divergence model's run means
  (``sim.divergence``, defaults fitted to docs/learning.md's tiny model);
* the controller (``psrl.adaptive_staleness.enable=true``, psrl.staleness = CEILING, its default limits and
  ``min``; it is not told the best bound), in the ``psrl`` policy and in the ``coordinator`` policy (psrl train's
  real coordinator and controller in virtual time).

The reference bound is the largest-throughput fixed bound whose run-mean divergence is inside the limits; the
figure is the controller's steps/h over that bound's (acceptance: >= 0.95).

    PYTHONPATH=src python benchmarks/adaptive_sim.py [--seeds 0 7] [--ceiling 4] [--steps 300] [key=value ...]

``key=value`` overrides the controller's keys (e.g. psrl.adaptive_staleness.every=2) or the divergence model's
(sim.divergence.lr_scale=1.6). Prints a table and ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from psrl.config import load_config
from psrl.sim import Workload, simulate
from psrl.sim.divergence import inside_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policies import SETTINGS, workload  # noqa: E402


def header(ceiling: int) -> str:
    """The table's header line (the table is ``header`` then one ``format_row`` per workload and seed)."""
    return (
        f"{'sigma':>5} {'setting':<13} {'seed':>4}  {'steps/h at fixed bound 0..' + str(ceiling):<44}"
        f" {'best in':>7} {'psrl+ad':>8} {'bound':>5} {'ratio':>6} {'coord+ad':>8} {'ratio':>6}"
    )


def format_row(row: dict) -> str:
    """One workload and seed: steps/h per fixed bound (``*``: outside the limits), the best bound inside them, the
    controller's steps/h, mean bound and ratio in the ``psrl`` and (when run) ``coordinator`` policies."""
    ok = row["inside_limits"]
    fx = " ".join(f"{v:7.0f}{'' if s in ok else '*'}" for s, v in enumerate(row["fixed_steps_per_hour"]))
    coord = ""
    if "coordinator_ratio" in row:
        coord = f"{row['coordinator_steps_per_hour']:8.0f} {row['coordinator_ratio']:6.3f}"
    return (
        f"{row['sigma']:>5} {row['setting']:<13} {row['seed']:>4}  {fx:<44} {row['best_bound']:>7} "
        f"{row['adaptive_steps_per_hour']:>8.0f} {row['adaptive_bound_mean']:>5.2f} {row['ratio']:>6.3f} {coord}"
    )


FOOTER = "(* = run-mean divergence outside the limits; ratio = controller steps/h / best-in-limits fixed bound's)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 7])
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--ceiling", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--no-coordinator", action="store_true", help="skip the coordinator policy (faster)")
    ap.add_argument("--results", type=Path, default=None, help="store the rows and the command here")
    ap.add_argument("overrides", nargs="*", help="psrl.adaptive_staleness.* / sim.divergence.* overrides")
    ns = ap.parse_args()
    base = Workload.from_config(load_config(None, ["psrl.adaptive_staleness.enable=true", *ns.overrides]))
    limits, model = base.adaptive, base.divergence
    t0 = time.perf_counter()
    rows = []
    print(
        f"limits: ess >= {limits.ess_min}, m2 <= {limits.m2_max}, kl <= {limits.kl_max}; every {limits.every}, "
        f"idle_frac {limits.idle_frac}, min {limits.min}, start {limits.start}; divergence model {model}; ceiling {ns.ceiling}"
    )
    print(header(ns.ceiling))
    for sigma in ns.sigmas:
        for setting in SETTINGS:
            for seed in ns.seeds:
                wl = workload(sigma, setting, ns.steps, eta=ns.ceiling, seed=seed, divergence=model)
                fixed = [simulate(wl.replace(staleness=s), "psrl") for s in range(ns.ceiling + 1)]
                ok = [s for s, r in enumerate(fixed) if inside_limits(r.extra, limits)]
                best = max(ok, key=lambda s: fixed[s].steps_per_hour)
                on = wl.replace(adaptive=dataclasses.replace(limits, enable=True))
                ad = simulate(on, "psrl")
                co = None if ns.no_coordinator else simulate(on, "coordinator")
                ref = fixed[best].steps_per_hour
                row = {
                    "sigma": sigma,
                    "setting": setting,
                    "seed": seed,
                    "fixed_steps_per_hour": [r.steps_per_hour for r in fixed],
                    "inside_limits": ok,
                    "best_bound": best,
                    "adaptive_steps_per_hour": ad.steps_per_hour,
                    "adaptive_bound_mean": ad.extra["staleness/bound"],
                    "adaptive_inside_limits": inside_limits(ad.extra, limits),
                    "ratio": ad.steps_per_hour / ref,
                }
                if co is not None:
                    row["coordinator_steps_per_hour"] = co.steps_per_hour
                    row["coordinator_ratio"] = co.steps_per_hour / ref
                rows.append(row)
                print(format_row(row), flush=True)
    print(FOOTER)
    ratios = [r["ratio"] for r in rows]
    co_ratios = [r["coordinator_ratio"] for r in rows if "coordinator_ratio" in r]
    summary = {
        "benchmark": "adaptive_sim",
        "ceiling": ns.ceiling,
        "steps": ns.steps,
        "seeds": ns.seeds,
        "workloads": len(rows),
        "min_ratio": min(ratios),
        "mean_ratio": round(sum(ratios) / len(ratios), 4),
        "min_coordinator_ratio": min(co_ratios) if co_ratios else None,
        "adaptive_inside_limits": sum(r["adaptive_inside_limits"] for r in rows),
        "acceptance_0_95": min(ratios) >= 0.95 and (not co_ratios or min(co_ratios) >= 0.95),
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    if ns.results:
        import results as stored

        stored.write(ns.results, summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
