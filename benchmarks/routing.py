"""What routing and the multi-level queue buy when decode speed depends on the batch (issue #11, item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/routing.py [--steps 30] [--seeds 0,1,2]

``psrl simulate``'s ``coordinator`` policy (psrl train's real coordinator, router and instances, in
virtual time) with ``sim.decode``: 2 rollout instances, the second at half speed; a decode step over
``n`` requests takes ``(0.02 + 0.002 n) / speed`` s. Heavy-tailed work: pareto(alpha 1.5) generation
times of median 1 s at 64 tokens/s (a median trajectory is 64 tokens, the tail thousands). 64 agent
workers, B = 16 groups x N = 4, staleness 2, train step 4 s. Each instance decodes at most 16 requests
at once (``sim.decode.max_running``); the rest wait at the instance, where the multi-level queue admits
the oldest ``V_traj`` first. Partial rollout with ``interrupt_as_prompt``: at each weight sync an
instance's requests are handed back and re-routed, so older requests queue behind newer ones
(instances pull greedily, ``check_req_before_sync`` off: with it on, a queue that never empties holds
every pull back until the instance is too stale, and all waiting requests share one ``V_traj``).

Prints steps/hour of each routing method with and without the multi-level queue, as a ratio to
round_robin without it (same seeds, same work), and the measured staleness; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from psrl.config import load_config
from psrl.sim import Workload, simulate

BASE = [
    "sim.decode.enable=true",
    "sim.decode.speeds=[1.0,0.5]",
    "sim.decode.max_running=16",
    "sim.gen_time.dist=pareto",
    "sim.gen_time.alpha=1.5",
    "sim.gen_time.median=1.0",
    "sim.gen_tokens_per_second=64",
    "sim.slots=64",
    "sim.train_time=4.0",
    "psrl.staleness=2",
    "psrl.staleness_buffer_entries=16",
    "psrl.rollout_n=4",
    "psrl.deployment.n_rollout_instances=2",
    "psrl.routing_strategy.enable_group_sticky=false",
    "psrl.partial_rollout.enable=true",
    "psrl.partial_rollout.interrupt_as_prompt=true",
    "psrl.sync_and_mig_strategy.sync.check_req_before_sync=false",
]
METHODS = ("round_robin", "request_num_balance", "throughput_optimal")


def workload(method: str, mlq: bool, steps: int, seed: int) -> Workload:
    over = BASE + [
        f"psrl.routing_strategy.method={method}",
        f"psrl.routing_strategy.enable_multi_priority_queue={str(mlq).lower()}",
        f"sim.steps={steps}",
        f"sim.seed={seed}",
    ]
    return Workload.from_config(load_config(None, over))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--results", type=Path, default=None, help="store every run (method, queue, seed) and the command")
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    import torch  # the coordinator's layers import it; one thread, the machine is shared

    torch.set_num_threads(1)
    seeds = [int(s) for s in ns.seeds.split(",")]
    rows = {}
    for method in METHODS:
        for mlq in (False, True):
            res = [simulate(workload(method, mlq, ns.steps, seed), "coordinator") for seed in seeds]
            rows[(method, mlq)] = res
    base = [r.steps_per_hour for r in rows[("round_robin", False)]]
    print(f"{'method':<22}{'mlq':<6}{'steps/h':>10}{'vs round_robin':>16}{'staleness mean':>16}{'max':>5}")
    out = {}
    for (method, mlq), res in rows.items():
        ratios = [r.steps_per_hour / b for r, b in zip(res, base)]
        sph = statistics.mean(r.steps_per_hour for r in res)
        ratio = statistics.mean(ratios)
        stale = statistics.mean(r.staleness_mean for r in res)
        print(
            f"{method:<22}{'on' if mlq else 'off':<6}{sph:>10.1f}{ratio:>15.3f}x{stale:>16.2f}"
            f"{max(r.staleness_max for r in res):>5}"
        )
        out[f"{method}{'+mlq' if mlq else ''}"] = round(ratio, 4)
        assert all(r.violations == 0 for r in res)
    if ns.results:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import results as stored

        runs = [
            {"method": method, "mlq": mlq, "seed": seed, **asdict(r)}
            for (method, mlq), res in rows.items()
            for seed, r in zip(seeds, res)
        ]
        stored.write(ns.results, {"steps": ns.steps, "seeds": seeds, "runs": runs})
    print(json.dumps({"benchmark": "routing", "steps": ns.steps, "seeds": seeds, "ratio_to_round_robin": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
