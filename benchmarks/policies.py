"""The reference comparison of staleness policies, on heavy-tailed generation times.

    .venv/bin/python benchmarks/policies.py [--steps 300] [--plot frontier.png] [--million] [--quick]

Workload: 64 generation slots, 16 groups x 4 trajectories per step, lognormal generation times
(median 1 s, sigma 0.5 / 1.0 / 1.5), eta = 2. Four training-time settings:

* "balanced": train_time = the time the slots need to generate one batch on average when they
  generate continuously (B*N*mean/slots = the mean generation time): generation bound = trainer
  bound, so the generators have no spare capacity at all;
* "gen-bound": half of that; "trainer-bound": twice that;
* "sync-balanced": train_time = the expected time the slots need to generate one batch from
  scratch (the mean makespan of B*N draws on the slots, i.e. a synchronous system's generation
  phase, tail included): the other reading of "balanced"; it leaves the generators spare capacity.

psrl also runs with batch-level redundancy B' = 1.25 B and 1.5 B, and with the proactive
``truncate`` filter. The acceptance rows are also run through psrl train's real coordinator in
virtual time (policy ``coordinator``), next to the simulator's model of it.

Prints one table (every policy x setting), the issue's acceptance numbers with their targets, and
the frontier (throughput against each policy's TRUE max staleness over an eta sweep) for the
balanced workloads. ``--million`` times psrl on 250 steps of 512 groups x 8 (1M trajectories).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from psrl.sim import Result, Workload, simulate
from psrl.sim.report import format_frontier, plot

SIGMAS = (0.5, 1.0, 1.5)
SETTINGS = ("gen-bound", "balanced", "trainer-bound", "sync-balanced")
_CAPACITY_FACTOR = {"gen-bound": 0.5, "balanced": 1.0, "trainer-bound": 2.0}
FRONTIER_ETAS = (0, 1, 2, 3, 4, 6, 8)


def workload(sigma: float, setting: str, steps: int, eta: int = 2, seed: int = 0, **changes) -> Workload:
    """The reference workload (``changes``: Workload fields, e.g. redundant_batch_size)."""
    B, N, slots = 16, 4, 64
    wl = Workload(slots=slots, steps=steps, staleness=eta, batch_size=B, redundant_batch_size=B,
                  group_size=N, redundant_group_size=N, dist="lognormal", median=1.0, sigma=sigma,
                  train_time=train_time(sigma, setting, B * N, slots), seed=seed)
    return wl.replace(**changes)


def train_time(sigma: float, setting: str, trajectories: int, slots: int) -> float:
    """Seconds of one training step in ``setting`` (lognormal, median 1)."""
    if setting == "sync-balanced":
        return mean_makespan(sigma, trajectories, slots)
    return _CAPACITY_FACTOR[setting] * trajectories * math.exp(sigma ** 2 / 2) / slots


def mean_makespan(sigma: float, trajectories: int, slots: int, batches: int = 20000) -> float:
    """Expected time ``slots`` need to generate ``trajectories`` lognormal(0, sigma) draws from scratch
    (Monte Carlo, fixed seed; one draw per slot when trajectories == slots, the case used here)."""
    if trajectories != slots:
        raise ValueError("mean_makespan assumes one trajectory per slot")
    draws = np.random.default_rng(12345).lognormal(0.0, sigma, (batches, trajectories))
    return float(draws.max(axis=1).mean())


# (label, policy, workload changes). sample_budget runs with trigger_parameter_sync_step = 2: at 1 its
# admission count is exactly AReaL's (docs/simulate.md), so its row would repeat areal's.
VARIANTS = [
    ("psrl", "psrl", {}),
    ("psrl B'=1.25B", "psrl", {"redundant_batch_size": 20}),
    ("psrl B'=1.5B", "psrl", {"redundant_batch_size": 24}),
    ("psrl truncate", "psrl", {"proactive_method": "truncate", "proactive_threshold": 4}),
    ("sync", "sync", {}),
    ("one_step_off", "one_step_off", {}),
    ("areal", "areal", {}),
    ("discard_requeue", "discard_requeue", {}),
    ("sample_budget", "sample_budget", {}),
]


def run_variant(label: str, policy: str, changes: dict, sigma: float, setting: str, steps: int, eta: int = 2) -> Result:
    """One row: the policy on the reference workload, labelled."""
    r = simulate(workload(sigma, setting, steps, eta=eta, **changes), policy)
    r.policy = label
    return r


def row(sigma: float, setting: str, label: str, r: Result) -> str:
    return (f"{sigma:>5}  {setting:<13}  {label:<17}  {r.steps_per_hour:>8.0f}  {r.ratio_to_ideal:>5.3f}  "
            f"{r.trainer_idle:>6.3f}  {r.generator_idle:>6.3f}  {r.staleness_mean:>5.2f}  {r.staleness_p99:>3}  "
            f"{r.staleness_max:>4}  {r.violations:>6}  {r.discarded_fraction:>6.3f}  {r.wasted_fraction:>6.3f}  "
            f"{r.length_bias:>6.3f}")


HEADER = ("sigma  setting        policy              steps/h  ratio  tr_idl  gn_idl  st_mn  p99   max  "
          "violat  discrd  wasted  lenbias")


def reference_table(steps: int) -> dict:
    """Print the big table; return the results keyed by (sigma, setting, label)."""
    print(f"eta = 2, 64 slots, 16 groups x 4, lognormal(median 1), {steps} steps; ratio = steps/h over "
          "min(generation bound, trainer bound)")
    print(HEADER)
    out = {}
    for sigma in SIGMAS:
        for setting in SETTINGS:
            for label, policy, changes in VARIANTS:
                r = run_variant(label, policy, changes, sigma, setting, steps)
                out[(sigma, setting, label)] = r
                print(row(sigma, setting, label, r))
        print()
    return out


def acceptance(results: dict, steps: int) -> None:
    """The issue's acceptance numbers at eta = 2 on both readings of "balanced", next to their targets;
    each also run through psrl train's real coordinator (virtual time) on the same workload."""
    checks = [
        ("psrl, sigma 0.5, no redundancy", 0.5, "psrl", {}, 0.80),
        ("psrl, sigma 0.5, B'=1.25B", 0.5, "psrl B'=1.25B", {"redundant_batch_size": 20}, 0.95),
        ("psrl, sigma 1.0, B'=1.5B", 1.0, "psrl B'=1.5B", {"redundant_batch_size": 24}, 0.95),
    ]
    for setting in ("balanced", "sync-balanced"):
        print(f"acceptance (eta = 2, {setting}; model = the psrl policy, real = psrl train's coordinator):")
        for text, sigma, label, changes, target in checks:
            r = results[(sigma, setting, label)]
            real = simulate(workload(sigma, setting, steps, **changes), "coordinator")
            verdict = "meets" if min(r.ratio_to_ideal, real.ratio_to_ideal) >= target else "BELOW"
            print(f"  {text:<32} ratio model {r.ratio_to_ideal:.3f} real {real.ratio_to_ideal:.3f}  "
                  f"target >= {target:.2f}  {verdict}  (violations {r.violations}/{real.violations}, "
                  f"wasted {r.wasted_fraction:.3f}, length_bias {r.length_bias:.3f})")
    no_red = [r for (s, st, lab), r in results.items() if lab == "psrl"]
    print(f"  psrl without redundancy, all settings: violations {sum(r.violations for r in no_red)}, "
          f"max discarded {max(r.discarded_fraction for r in no_red):.3f}, "
          f"length_bias in [{min(r.length_bias for r in no_red):.3f}, {max(r.length_bias for r in no_red):.3f}]")
    print()


def frontier_section(steps: int, plot_path: str | None) -> None:
    """Sweep eta on the balanced workloads; tabulate (and plot) throughput vs TRUE max staleness."""
    for sigma in SIGMAS:
        results = []
        for eta in FRONTIER_ETAS:
            results.extend(run_variant(*v, sigma, "balanced", steps, eta=eta) for v in VARIANTS)
        print(f"balanced, sigma {sigma}: eta swept over {list(FRONTIER_ETAS)}")
        print(format_frontier(results))
        print(format_frontier(results, min_length_bias=0.95))
        print()
        if plot_path:
            path = plot_path.replace(".png", f"_sigma{sigma}.png")
            plot(results, path, title=f"balanced workload, lognormal sigma {sigma}")
            print(f"plot written to {path}\n")


def million() -> None:
    """Time psrl on ~1M trajectories: 250 steps of 512 groups x 8, 4096 slots, balanced, sigma 1."""
    wl = Workload(slots=4096, steps=250, staleness=2, batch_size=512, redundant_batch_size=512, group_size=8,
                  redundant_group_size=8, sigma=1.0, train_time=math.exp(0.5))
    t0 = time.perf_counter()
    r = simulate(wl, "psrl")
    dt = time.perf_counter() - t0
    print(f"1M-trajectory run: psrl, {r.launched_trajectories} trajectories launched, "
          f"{r.trained_trajectories} trained, {wl.steps} steps: {dt:.1f} s wall, {dt / 60:.2f} of the 60 s budget "
          f"(ratio {r.ratio_to_ideal:.3f}, violations {r.violations})")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", default=None, help="write the frontier plots to FILE_sigma<s>.png")
    ap.add_argument("--million", action="store_true", help="also time the 1M-trajectory psrl run")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ns = ap.parse_args(argv)
    steps = 12 if ns.quick else ns.steps
    t0 = time.perf_counter()
    results = reference_table(steps)
    acceptance(results, steps)
    frontier_section(steps, ns.plot)
    if ns.million:
        million()
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
