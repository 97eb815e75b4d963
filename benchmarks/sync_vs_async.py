"""Synchronous vs asynchronous training on the agentic task: seconds per step and reward, side by side.

Runs the real coordinator (real tiny model, real trainer, the ``tool_arith`` task whose tool
latency is lognormal, i.e. heavy-tailed) at ``psrl.staleness`` 0, 1, 2 and 4 with the same
seed, the same warm-started weights and the same number of steps. ``staleness=0`` is
synchronous training (the trainer waits for every group of a batch, generation waits for the
trainer); larger values let generation run ahead by up to that many versions.

Printed per run: seconds per step, speedup over ``staleness=0``, reward reached (mean training
reward over the last third of the steps, and the accuracy of the final weights on a fixed set
of held-out prompts), and the maximum staleness observed. Then, for the margin the workload
allows, each run is replayed in ``psrl simulate`` (``benchmarks/sim_vs_real.py``: its own
generation times and step time): measured vs predicted seconds per step after warm-up, and the
ideal ``min(generation bound, trainer bound)`` no policy can beat. The last line is one JSON object::

    {"speedup": {"1": x, "2": y, "4": z}, "reward": {"0": a, "1": b, "2": c, "4": d},
     "max_staleness": {...}, "eval": {...}, "seconds_per_step": {...}, "simulated": {...}}

Usage: ``python benchmarks/sync_vs_async.py [--steps N] [--staleness 0 1 2 4] [key=value ...]``
(overrides as for ``psrl train``). Takes about three minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from psrl.config import load_config
from psrl.runtime.local import build
from psrl.runtime.recorder import RunRecorder
from psrl.runtime.validate import validate
from psrl.train import Trainer, build_task_and_policy, seed_everything, warm_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_vs_real import compare_run  # noqa: E402

# The benchmark workload: heavy-tailed tool calls dominate a synchronous step.
# 2 instances x 16 workers = one batch (B * N = 8 * 4 trajectories) in flight: more workers than
# a batch do not help a no-drop protocol (the extra reservations only collect the stragglers).
WORKLOAD = [
    "task.tool_latency_median=0.2",
    "task.tool_latency_sigma=1.0",
    "psrl.deployment.n_rollout_instances=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=16",
]


def build_cfg(overrides: list[str], staleness: int):
    return load_config(None, WORKLOAD + list(overrides) + [f"psrl.staleness={staleness}"])


def warm_weights(cfg) -> dict:
    """Warm-start once; every run starts from these weights (a fair, cheaper comparison)."""
    seed_everything(cfg.trainer.seed)
    task, policy = build_task_and_policy(cfg)
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer)
    warm_start(cfg, task, trainer, log=lambda line: print(line, flush=True))
    return policy.export_state()


def run_one(cfg, weights: dict, steps: int, run_dir: Path) -> tuple[list[dict], object, object]:
    """One asynchronous (or, at staleness 0, synchronous) run from ``weights``, recorded in ``run_dir``."""
    recorder = RunRecorder(run_dir)
    recorder.write_config(cfg)
    coord = build(cfg, recorder, weights=weights)  # psrl train's own wiring and engines
    task, policy = coord.agents.task, coord.trainer.policy
    try:
        rows = asyncio.run(coord.run(steps))
    finally:
        recorder.close()
    return rows, task, policy


def evaluate(cfg, task, policy, n: int = 128) -> float:
    """Mean score of the final weights on ``n`` fixed prompts (tool latency off, greedy): ``val/reward``."""
    rng = random.Random(12345)
    prompts = [task.sample_prompt(rng) for _ in range(n)]
    return asyncio.run(validate(task, policy, prompts, 1, cfg.trainer.temperature, cfg.trainer.top_p))["val/reward"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    etas = sorted(set(args.staleness) | {0})
    weights = warm_weights(build_cfg(args.overrides, 0))
    out = {"seconds_per_step": {}, "reward": {}, "eval": {}, "max_staleness": {}, "simulated": {}}
    runs = Path(tempfile.mkdtemp(prefix="sync_vs_async-"))
    for eta in etas:
        cfg = build_cfg(args.overrides, eta)
        t0 = time.perf_counter()
        rows, task, policy = run_one(cfg, weights, args.steps, runs / f"staleness{eta}")
        wall = time.perf_counter() - t0
        sim = compare_run(runs / f"staleness{eta}")
        out["simulated"][str(eta)] = {
            k: round(sim[k], 4) for k in ("measured_s_per_step", "predicted_s_per_step", "ideal_s_per_step")
        }
        tail = rows[-max(1, len(rows) // 3) :]
        key = str(eta)
        out["seconds_per_step"][key] = round(rows[-1]["time"] / len(rows), 4)
        out["reward"][key] = round(sum(r["reward/mean"] for r in tail) / len(tail), 4)
        out["max_staleness"][key] = max(int(r["staleness/max"]) for r in rows)
        out["eval"][key] = round(evaluate(cfg, task, policy), 4)
        print(
            f"staleness {eta}: {out['seconds_per_step'][key]:.3f} s/step ({wall:.1f}s wall), "
            f"reward {out['reward'][key]:.3f}, eval {out['eval'][key]:.3f}, max staleness {out['max_staleness'][key]}",
            flush=True,
        )
    base = out["seconds_per_step"]["0"]
    out["speedup"] = {k: round(base / v, 3) for k, v in out["seconds_per_step"].items() if k != "0"}
    print()
    print(f"{'staleness':>9} {'s/step':>8} {'speedup':>8} {'reward':>7} {'eval':>6} {'max stale':>9}")
    for eta in etas:
        k = str(eta)
        sp = out["speedup"].get(k, 1.0)
        print(
            f"{eta:>9} {out['seconds_per_step'][k]:>8.3f} {sp:>7.2f}x {out['reward'][k]:>7.3f} "
            f"{out['eval'][k]:>6.3f} {out['max_staleness'][k]:>9}"
        )
    print()
    print("the margin the workload allows (each run replayed in psrl simulate; seconds per step after warm-up):")
    print(f"{'staleness':>9} {'measured':>9} {'simulated':>9} {'ideal':>7} {'measured/ideal':>15}")
    for eta in etas:
        m = out["simulated"][str(eta)]
        print(
            f"{eta:>9} {m['measured_s_per_step']:>9.3f} {m['predicted_s_per_step']:>9.3f} {m['ideal_s_per_step']:>7.3f} "
            f"{m['ideal_s_per_step'] / m['measured_s_per_step']:>15.2f}"
        )
    print(f"(run directories: {runs})")
    ordered = {
        "speedup": out["speedup"],
        "reward": out["reward"],
        "max_staleness": out["max_staleness"],
        "eval": out["eval"],
        "seconds_per_step": out["seconds_per_step"],
        "simulated": out["simulated"],
    }
    print(json.dumps(ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
