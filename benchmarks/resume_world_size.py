"""A checkpoint continued at another world size: how far its next step lands from the uninterrupted run's.

The tiny model on ``arith`` (``model.n_layer=1 n_embd=32 n_head=2``), two fixed batches (skewed lengths, a masked
token, behaviour log-probs off the policy's by noise, tokens of two versions: the corrections act). Uninterrupted:
the ``Trainer`` at one rank (in process) steps both. ``1 -> 2``: one rank steps batch 1 and checkpoints (DCP,
``ranks/``); two gloo ranks load it and step batch 2. ``2 -> 1``: two ranks step batch 1 and checkpoint; one rank
loads it and steps batch 2. ``AdamW restarted``: the one-rank checkpoint loaded, its optimizer state dropped, batch
2 stepped -- what a resume that lost AdamW would give. Each figure is the largest absolute weight difference from the uninterrupted run after batch 2.
``tests/runtime/test_train_sharded.py`` checks the same two resumes (slow) against 1e-4.

Usage: ``PYTHONPATH=src python benchmarks/resume_world_size.py [--results FILE]``; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as stored  # noqa: E402
from psrl.config import load_config  # noqa: E402
from psrl.models import build_policy  # noqa: E402
from psrl.staleness import Batch  # noqa: E402
from psrl.tasks import get_task  # noqa: E402
from psrl.train import Trainer  # noqa: E402
from psrl.types import Trajectory  # noqa: E402

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "task.name=arith"]


def batch(policy, version: int) -> Batch:
    """Two groups of three (the batch of ``tests/runtime/test_train_sharded.py``)."""
    g = torch.Generator().manual_seed(7 + version)
    groups = []
    for k, lengths in enumerate([[3, 17, 5], [2, 9, 12]]):
        group = []
        for j, n in enumerate(lengths):
            prompt = torch.randint(1, 20, (4,), generator=g).tolist()
            response = torch.randint(1, 20, (n,), generator=g).tolist()
            with torch.no_grad():
                logp = policy.sequence_logprobs([prompt], [response])[0]
            behav = (logp + 0.2 * torch.randn(n, generator=g)).tolist()
            mask = [1] * n
            mask[n // 2] = 0
            versions = [version - (j % 2)] * n
            group.append(
                Trajectory(f"{k}-{j}", f"g{k}", min(versions), prompt, response, behav, mask, versions, float(j))
            )
        groups.append(group)
    return Batch(version, groups, ["a", "b"], [version - 1, version - 1])


def max_diff(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=None, help="store the figures and the command here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(None, TINY)

    def fresh():
        return build_policy(cfg.model, get_task(cfg.task, seed=0), seed=0)

    work = Path(tempfile.mkdtemp(prefix="psrl-resume-"))

    def one():
        return Trainer(fresh(), cfg.algorithm, cfg.trainer, 1, work)

    batches = [batch(fresh(), v) for v in range(2)]
    single = one()
    for v, b in enumerate(batches):
        single.step(b)
        single.publish(v + 1)
    want = single.policy.model.state_dict()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        first = one()
        first.step(batches[0])
        first.publish(1)
        first.save(root / "at1")

        started = time.perf_counter()
        two = Trainer(fresh(), cfg.algorithm, cfg.trainer, 2, root / "two")
        try:
            two.load(root / "at1")
            two.step(batches[1])
            two.publish(2)
            out["1_to_2"] = max_diff(two.latest_policy().model.state_dict(), want)
        finally:
            two.close()
        out["1_to_2_s"] = time.perf_counter() - started

        started = time.perf_counter()
        back = Trainer(fresh(), cfg.algorithm, cfg.trainer, 2, root / "back")
        try:
            back.step(batches[0])
            back.publish(1)
            back.save(root / "at2")
        finally:
            back.close()
        again = one()
        again.load(root / "at2")
        again.step(batches[1])
        out["2_to_1"] = max_diff(again.policy.model.state_dict(), want)
        out["2_to_1_s"] = time.perf_counter() - started

        lost = one()
        lost.load(root / "at1")
        lost.start().worker.optimizer.state.clear()  # type: ignore[attr-defined]  # the weights kept, AdamW lost
        lost.step(batches[1])
        out["adamw_restarted"] = max_diff(lost.policy.model.state_dict(), want)
    out["moved"] = max_diff(want, fresh().model.state_dict())  # how far the two steps moved the weights
    print(
        f"max |weight - uninterrupted| after the next step: 1 -> 2 {out['1_to_2']:.2g}, 2 -> 1 {out['2_to_1']:.2g}, "
        f"AdamW restarted {out['adamw_restarted']:.2g} (the two steps moved the weights {out['moved']:.2g})"
    )
    if args.results:
        stored.write(args.results, {"resume": out})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
