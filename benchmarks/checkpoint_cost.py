"""What a checkpoint costs the training step: written synchronously vs captured and written by a thread.

Loads a model (``model.path``, e.g. SmolLM2-135M: ~1.6 GB of weights + AdamW state), takes one real
optimiser step so AdamW has its moments, then measures side by side, ``--repeats`` times each:

* ``sync``: ``Trainer.save`` on the training thread -- the time the next step waits;
* ``capture``: ``Trainer.state_dict`` (the copy ``trainer.checkpoint_in_background`` takes between
  steps) -- the time the next step waits in the background mode;
* ``step``: one training step alone, and one while the writer thread saves the captured copy -- what the
  concurrent write costs the step (both share the CPU cores).

Usage: ``python benchmarks/checkpoint_cost.py model.path=DIR [--repeats 3] [key=value ...]``. The last line
is one JSON object with the mean seconds of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    ns, overrides = p.parse_known_args(argv)
    torch.set_num_threads(1)
    from psrl.config import load_config
    from psrl.rollout.fakes import random_batch
    from psrl.train import Trainer, build_task_and_policy

    cfg = load_config(None, ["task.name=arith", *overrides])
    task, policy = build_task_and_policy(cfg)
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer)
    batch = random_batch(task, version=0, groups=4, n=4, lengths=(8, 32))
    trainer.step(batch)  # AdamW moments exist from here on
    out = Path(tempfile.mkdtemp(prefix="psrl-ckcost-"))
    sync, capture, alone, during = [], [], [], []
    for k in range(ns.repeats):
        t = time.perf_counter()
        trainer.save(out / f"sync{k}")
        sync.append(time.perf_counter() - t)
        batch = batch._replace(version=trainer.version)
        t = time.perf_counter()
        trainer.step(batch)
        alone.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = trainer.state_dict()
        capture.append(time.perf_counter() - t)
        writer = threading.Thread(target=trainer.save, args=(out / f"bg{k}", state))
        writer.start()
        batch = batch._replace(version=trainer.version)
        t = time.perf_counter()
        trainer.step(batch)
        during.append(time.perf_counter() - t)
        writer.join()
    size = sum(f.stat().st_size for f in (out / "sync0").rglob("*") if f.is_file()) / 2**30
    m = {
        name: round(statistics.mean(v), 3)
        for name, v in (
            ("sync_save_s", sync),
            ("capture_s", capture),
            ("step_alone_s", alone),
            ("step_during_write_s", during),
        )
    }
    blocking_sync = m["sync_save_s"] + m["step_alone_s"]
    blocking_bg = m["capture_s"] + m["step_during_write_s"]
    print(
        f"checkpoint {size:.2f} GiB: sync save {m['sync_save_s']:.2f}s | capture {m['capture_s']:.2f}s | step "
        f"{m['step_alone_s']:.2f}s alone, {m['step_during_write_s']:.2f}s while the writer thread saves"
    )
    print(
        f"a checkpointed step: {blocking_sync:.2f}s synchronous vs {blocking_bg:.2f}s in the background "
        f"({blocking_sync / blocking_bg:.2f}x)"
    )
    print(
        json.dumps(
            {
                **m,
                "checkpoint_gib": round(size, 3),
                "step_with_sync_save_s": round(blocking_sync, 3),
                "step_with_background_save_s": round(blocking_bg, 3),
                "speedup": round(blocking_sync / blocking_bg, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
