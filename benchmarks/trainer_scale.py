"""The sharded trainer at 1 vs 2 ranks on SmolLM2-135M's architecture (issue #22, acceptance): what a rank holds,
what a step costs, what a publish costs.

The model is built from SmolLM2-135M's configuration (Llama: 30 layers, 576 wide, 9 heads / 3 KV heads, vocabulary
49152, tied embedding and head) with random weights -- nothing is downloaded. One step's batch (``--seqs``
sequences of ``--prompt`` + ``--response`` random tokens, 1 minibatch) is trained by the in-process worker (world
size 1, no process group) and by 2 spawned gloo ranks (FSDP2), each from the same weights; then each publishes the
version once. ``--layers`` shrinks the model for a quick check of the script itself.

Usage: ``PYTHONPATH=src python benchmarks/trainer_scale.py [--layers 30] [--seqs 8]``. The last line is one JSON
object: ``state_bytes_ratio`` (parameter + optimiser bytes of one rank at 2 ranks over the single process's),
``step_time_ratio`` (2-rank step seconds over 1-rank; on a 2-core CPU recorded, not gated), ``publish_s`` (2 ranks),
peak RSS per rank, and the raw figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_smollm2(layers: int, device: str) -> torch.nn.Module:
    """SmolLM2-135M's architecture, random weights (seed 0); ``meta``: shapes only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            return LlamaForCausalLM(cfg)


def _batch(seqs: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (prompt,), generator=g).tolist() for _ in range(seqs)]
    responses = [torch.randint(3, 49152, (response,), generator=g).tolist() for _ in range(seqs)]
    adv = torch.randn(seqs, generator=g).tolist()
    masks = [[1.0] * response for _ in range(seqs)]
    return prompts, responses, adv, masks


def _measure(ranks, world: int, batch, algo, root: Path) -> dict[str, float]:
    from psrl.train.planner import plan
    from psrl.train.worker import StepInput, step_input

    prompts, responses, adv, masks = batch
    p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], world, 1, None)
    old: dict[int, list[float]] = {}
    for part in ranks.call("logprobs", StepInput(p, prompts, responses)):
        old.update(part)
    inp = step_input(p, prompts, responses, old, [old[i] for i in range(len(prompts))], adv, masks, algo)
    t0 = time.perf_counter()
    metrics = ranks.call("train_step", inp)[0]
    step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ranks.call("publish", (1, str(root), 1, 256, torch.float32))
    publish_s = time.perf_counter() - t0
    usage = ranks.call("usage")
    return {
        "step_s": step_s,
        "publish_s": publish_s,
        "loss": float(metrics["train/loss"]),
        "state_bytes": max(u["param_bytes"] + u["optim_bytes"] for u in usage),
        "peak_rss_bytes": max(u["peak_rss_bytes"] for u in usage),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--results", type=Path, default=None, help="store the figures and the command here")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig
    from psrl.train.launch import InProcess, LocalRanks
    from psrl.train.worker import WorkerSpec

    algo = AlgorithmConfig()
    spec = WorkerSpec(build=functools.partial(build_smollm2, ns.layers), pad_id=2, algo=algo, lr=1e-5)
    batch = _batch(ns.seqs, ns.prompt, ns.response)
    with tempfile.TemporaryDirectory() as tmp:
        one = _measure(InProcess(spec), 1, batch, algo, Path(tmp) / "w1")
        print(f"1 rank: {one}", file=sys.stderr, flush=True)
        with LocalRanks(spec, 2, reply_timeout_s=1800.0, log_dir=Path(tmp) / "logs") as ranks:
            two = _measure(ranks, 2, batch, algo, Path(tmp) / "w2")
        print(f"2 ranks: {two}", file=sys.stderr, flush=True)
    out = {
        "layers": ns.layers,
        "tokens": ns.seqs * (ns.prompt + ns.response),
        "state_bytes_ratio": two["state_bytes"] / one["state_bytes"],
        "step_time_ratio": two["step_s"] / one["step_s"],
        "publish_s": two["publish_s"],
        "publish_s_1rank": one["publish_s"],
        "step_s_1rank": one["step_s"],
        "step_s_2ranks": two["step_s"],
        "peak_rss_bytes_1rank": one["peak_rss_bytes"],
        "peak_rss_bytes_per_rank_2ranks": two["peak_rss_bytes"],
        "loss_1rank": one["loss"],
        "loss_2ranks": two["loss"],
    }
    if ns.results:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import results as stored

        stored.write(ns.results, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
