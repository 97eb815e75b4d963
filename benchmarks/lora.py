"""What LoRA saves (issue #36, acceptance): bytes per published version and per-rank optimiser state, LoRA over full
fine-tuning, measured side by side on the same model at 1 and 2 ranks.

Model: SmolLM2-135M's shape (``benchmarks/weights_scale.py``'s ``small``: a Llama with random weights, nothing is
downloaded). Each configuration (full or ``model.lora_rank=8``, ``lora_alpha=16``, ``target_modules=all-linear``
x 1 or 2 ranks) runs in a fresh process: the real :class:`psrl.train.Trainer` (rank processes at 2 ranks, versions
as files the driver's ``hf`` engine reads) publishes its first version, trains one step, publishes the next, and
the engine loads each. It reads:

* ``version_bytes`` -- ``weights/bytes`` of the step's version (with LoRA the adapter's; the first version of a set
  of ranks also carries the base: ``first_version_bytes``);
* ``optim_bytes`` -- each rank's AdamW state (``usage``), the largest over the ranks;
* ``sync_s`` -- from the optimiser step's end until the engine serves the version.

Ends with one JSON line: the runs, and per world size ``bytes_ratio`` (LoRA's version / full fine-tuning's: the
acceptance says <= 0.03) and ``optim_ratio`` (LoRA's per-rank optimiser state / full fine-tuning's: <= 0.05).

    python benchmarks/lora.py --results docs/results/lora.json     # ~5 min on 2 cores
    python benchmarks/lora.py --layers 1                          # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weights_scale import _batch, build_llama  # noqa: E402

RANK, ALPHA = 8, 16


def one(mode: str, world: int, layers: int | None) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models import Policy
    from psrl.rollout.engines.hf import HFEngine
    from psrl.train import Trainer
    from psrl.train.lora import LoraSpec

    model = build_llama("small", layers)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = Policy(model, SimpleNamespace(pad_id=2), seed=0)
    engine = HFEngine(policy.replica(seed=1))
    lora = LoraSpec(RANK, ALPHA) if mode == "lora" else None
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            policy, AlgorithmConfig(), TrainerConfig(lr=1e-5), world, tmp, in_memory=False, keep=2, lora=lora
        )
        try:
            ranks = trainer.start()
            first = trainer.publish(0)
            asyncio.run(engine.update_weights(0, trainer.out))
            trainer.step(_batch(0))
            step_end = time.perf_counter()
            pub = trainer.publish(1)
            asyncio.run(engine.update_weights(1, trainer.out))
            sync_s = time.perf_counter() - step_end
            usage = ranks.call("usage")
        finally:
            trainer.close()
    return {
        "mode": mode,
        "world": world,
        "model_bytes": model_bytes,
        "first_version_bytes": first["weights/bytes"],
        "version_bytes": pub["weights/bytes"],
        "optim_bytes": max(u["optim_bytes"] for u in usage),
        "param_bytes": max(u["param_bytes"] for u in usage),
        "sync_s": sync_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--results", type=Path, default=None, help="store the runs and the command here (docs/results)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "WORLD"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.one:
        print(json.dumps(one(ns.one[0], int(ns.one[1]), ns.layers)))
        return 0
    import results as stored

    runs = []
    for world in (int(w) for w in ns.worlds.split(",")):
        for mode in ("full", "lora"):
            cmd = [sys.executable, __file__, "--one", mode, str(world)]
            if ns.layers is not None:
                cmd += ["--layers", str(ns.layers)]
            run = stored.child_run(cmd, f"{mode} at {world} rank(s)")
            print(f"  {run}", file=sys.stderr, flush=True)
            runs.append(run)
    ratios = {}
    for world in sorted({r["world"] for r in runs}):
        full, lora = (next(r for r in runs if (r["mode"], r["world"]) == (m, world)) for m in ("full", "lora"))
        ratios[str(world)] = {
            "bytes_ratio": lora["version_bytes"] / full["version_bytes"],
            "optim_ratio": lora["optim_bytes"] / full["optim_bytes"],
        }
    summary = {
        "model": "SmolLM2-135M shape, random weights" + (f", {ns.layers} layers" if ns.layers else ""),
        "lora": {"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": ["all-linear"]},
        "runs": runs,
        "ratios": ratios,
        "bytes_ratio_max": max(r["bytes_ratio"] for r in ratios.values()),
        "optim_ratio_max": max(r["optim_ratio"] for r in ratios.values()),
        "not_run": "vLLM engines (adapter loading on vLLM is not built on this branch)",
    }
    if ns.results is not None:
        stored.write(ns.results, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
