"""Does the openai-only calculator agent learn? ``psrl train examples/agent_calculator/smollm2.yaml`` over seeds.

The supervised warm start from ``task.demonstration`` that the YAML sets runs once (at ``trainer.seed`` 0,
kept as ``OUT/warm.pt`` and reused by a later invocation on the same ``--out``: on 2 shared cores it takes
longer than the RL steps); every seed then runs ``--steps`` RL steps of the example from those weights
(SmolLM2-135M-Instruct on ``hf``, the agent of ``examples/agent_calculator/agent.py`` reached through the
endpoint), so the seeds differ in sampling, data order and RL, not in the warm start. Per seed it keeps every step's training
reward (``reward/mean``) and tool-call fraction (``batch/tool_call_frac``), the warm start's loss, the run's time,
and the staleness audit of its trajectories (every trained trajectory: ``0 <= consumed_version - V_traj <=
psrl.staleness``, its tokens' versions within ``[V_traj, consumed_version]``). Per seed it prints the mean reward
of the first and the last quarter of the steps, and whether the last is higher; its LAST line is one JSON object:
``{"seeds", "reward_first_quarter", "reward_last_quarter", "rose", "tool_call_frac_step1", "violations"}``
(means over seeds; ``rose`` counts the seeds whose last quarter beat their first).

Seeds already stored in ``--results`` by a run of the same settings (model, steps, overrides, warm start) are
kept, not run again: the seeds can run one invocation at a time (on a shared machine, each seed's run is one
bounded job), and the stored command names every seed the file holds.

    PYTHONPATH=src python benchmarks/agent_learning.py --seeds 0 1 2 --steps 24 \
        --results docs/results/agent_learning.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from psrl.config import load_config
from psrl.models.smollm2 import hf_dir
from psrl.runtime.local import run
from psrl.runtime.recorder import read_jsonl
from psrl.train import Trainer, build_task_and_policy, seed_everything, warm_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as stored  # noqa: E402

CONFIG = stored.ROOT / "examples" / "agent_calculator" / "smollm2.yaml"
CURVES = ("reward/mean", "batch/tool_call_frac")


def audit(records: list[dict], staleness: int) -> dict:
    """Trained trajectories and the ones that break the bound (none may)."""
    trained = [r for r in records if r["status"] == "trained"]
    bad = 0
    for r in trained:
        lag = r["consumed_version"] - r["v_traj"]
        seg = r.get("segment_versions") or []
        bad += not (0 <= lag <= staleness) or bool(seg and (min(seg) < r["v_traj"] or max(seg) > r["consumed_version"]))
    return {"trained": len(trained), "violations": bad, "failed": sum(r["status"] == "error" for r in records)}


def quarters(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last quarter of ``values`` (at least one value each)."""
    q = max(1, len(values) // 4)
    return statistics.fmean(values[:q]), statistics.fmean(values[-q:])


def config(seed: int, steps: int, overrides: list[str], model: str = "smollm2"):
    """The example's config at ``seed``; ``model`` ``builtin`` keeps its built-in model (the smoke test's)."""
    args = [f"trainer.seed={seed}", f"trainer.total_steps={steps}", "trainer.resume=false"]
    if model == "smollm2":
        args.append(f"model.path={hf_dir()}")
    return load_config(str(CONFIG), args + overrides)


def warm(cfg, path: Path) -> tuple[dict, dict]:
    """The warm start of ``cfg`` (its weights, and what it said and took), made once and kept at ``path``."""
    if path.exists():
        return torch.load(path, weights_only=True)
    said: list[str] = []
    t0 = time.perf_counter()
    seed_everything(cfg.trainer.seed)
    task, policy = build_task_and_policy(cfg)
    losses = warm_start(cfg, task, Trainer(policy, cfg.algorithm, cfg.trainer), log=said.append)
    info = {
        "steps": len(losses),
        "batch": cfg.trainer.warm_start_batch,
        "lr": cfg.trainer.warm_start_lr,
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(losses[-1], 4) if losses else None,
        "losses": [round(x, 4) for x in losses],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(*said, info, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save((policy.export_state(), info), path)
    return policy.export_state(), info


def one_seed(seed: int, steps: int, overrides: list[str], out: Path, weights: dict, model: str) -> dict:
    run_dir = out / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a recorder appends: an earlier run's trajectories would be audited too
    cfg = config(seed, steps, overrides, model)
    t0 = time.perf_counter()
    history = run(cfg, str(run_dir), log=lambda line: print(line, flush=True), weights=weights)
    seconds = time.perf_counter() - t0
    curves = {k: [float(m[k]) for m in history] for k in CURVES}
    first, last = quarters(curves["reward/mean"])
    return {
        "seed": seed,
        "steps": len(history),
        "seconds": round(seconds, 1),
        "curves": curves,
        "reward_first_quarter": round(first, 4),
        "reward_last_quarter": round(last, 4),
        "audit": audit(read_jsonl(run_dir / "trajectories.jsonl"), cfg.psrl.staleness),
    }


def stored_runs(path: Path, settings: dict) -> dict[int, dict]:
    """The runs, by seed, that ``path`` holds from a run of exactly ``settings`` (none if it holds another's)."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if any(old.get(k) != v for k, v in settings.items()):
        return {}
    return {r["seed"]: r for r in old["runs"]}


def seeds_argv(argv: list[str], seeds: list[int]) -> list[str]:
    """``argv`` with its ``--seeds`` list replaced by ``seeds`` (the command that makes the whole stored file)."""
    if "--seeds" not in argv:
        argv = [argv[0], "--seeds", *map(str, seeds), *argv[1:]]
    out, skip = [], False
    for a in argv:
        if a == "--seeds":
            out += ["--seeds", *map(str, seeds)]
            skip = True
        elif skip and a.lstrip("-").isdigit() and not a.startswith("--"):
            continue
        else:
            skip = False
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--model", choices=("smollm2", "builtin"), default="smollm2")
    ap.add_argument("--out", default="/tmp/agent_learning", help="the runs' directories (one per seed)")
    ap.add_argument("--results", default=None, help="store the curves here (docs/results/agent_learning.json)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    over = list(args.overrides)
    weights, warm_info = warm(config(0, args.steps, over, args.model), Path(args.out) / "warm.pt")
    settings = {"config": str(CONFIG.relative_to(stored.ROOT)), "model": args.model, "overrides": over}
    settings |= {"steps": args.steps, "warm_start": warm_info}
    kept = stored_runs(Path(args.results), settings) if args.results else {}
    runs: list[dict] = []
    for seed in args.seeds:
        if seed in kept:
            runs.append(kept.pop(seed))
            print(f"seed {seed}: kept from {args.results} (same settings)", flush=True)
            continue
        r = one_seed(seed, args.steps, over, Path(args.out), weights, args.model)
        runs.append(r)
        verdict = "rose" if r["reward_last_quarter"] > r["reward_first_quarter"] else "did not rise"
        print(
            f"seed {seed}: reward first quarter {r['reward_first_quarter']:.3f}, last {r['reward_last_quarter']:.3f} "
            f"({verdict}); tool_call_frac {' '.join(f'{x:.2f}' for x in r['curves']['batch/tool_call_frac'])}; "
            f"audit {r['audit']}; {r['seconds']:.0f} s",
            flush=True,
        )
        if args.results:  # after every seed: a long run that is stopped keeps the seeds it finished
            held = sorted([*runs, *kept.values()], key=lambda x: x["seed"])
            command = stored.command_line(seeds_argv(sys.argv, [x["seed"] for x in held]))
            stored.write(Path(args.results), settings | {"runs": held}, command=command)
    summary = {
        "seeds": len(runs),
        "reward_first_quarter": round(statistics.fmean(r["reward_first_quarter"] for r in runs), 4),
        "reward_last_quarter": round(statistics.fmean(r["reward_last_quarter"] for r in runs), 4),
        "rose": sum(r["reward_last_quarter"] > r["reward_first_quarter"] for r in runs),
        "tool_call_frac_step1": round(statistics.fmean(r["curves"]["batch/tool_call_frac"][0] for r in runs), 4),
        "violations": sum(r["audit"]["violations"] for r in runs),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
