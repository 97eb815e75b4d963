"""GPU check of the trainer and the weight path (issues #22 item 8, #33 item 7), for one lent H100/H200; also runs
on CPU (a smoke run). What a GPU must show and a CPU cannot, in one command, one JSON line, <= 10 minutes on one H100.

Five parts, on SmolLM2-135M's architecture (Llama, 30 layers, tied embedding; random weights from its config:
nothing is downloaded; ``--tiny``: a 2-layer, 64-wide model for a smoke run):

1. **mixed precision** (``trainer``): the same ``--steps`` batches trained from the same weights by
   * the rank's code in fp32 (:class:`~psrl.train.worker.RankWorker` at world size 1) -- the reference;
   * world size 1 with ``model.dtype`` (``--dtype``, bf16): bf16 forward and backward over fp32 master weights
     (:mod:`psrl.train.masters`: what ``psrl train model.dtype=bfloat16`` runs at one rank);
   * the sharded rank's code: FSDP2 over a process group of one (NCCL on CUDA, gloo on CPU) with the
     mixed-precision policy (:func:`psrl.train.shard.mixed_precision`: bf16 compute, fp32 masters and reductions);
   each checked against fp32 over all the steps (the first minibatch's loss alone proves nothing: its ratio is 1):
   every step's loss within :data:`LOSS_RTOL`, the last step's log-probs within :data:`LOGPROB_ATOL`, the whole
   update's cosine to the fp32 update >= :data:`UPDATE_COSINE`; tokens/s of each;
2. **publish**: the sharded rank writes ``--versions`` versions (``weights/v{N}``, safetensors + manifest): seconds
   and GB/s each;
3. **sync** (``sync``): the real :class:`~psrl.train.Trainer` at world size 1 on the device and an ``hf`` engine
   replica there, per transport (``memory``: the in-process rank's tensors; ``files``: ``weights/v{N}``): seconds
   from the optimiser step's end until the engine serves the version, per GB of the version's bytes;
4. **collective into vLLM** (``collective_vllm``): ``psrl train rollout.engine=vllm weights.transport=collective``
   on the device for a few steps, its ``time/sync_s`` per GB of ``weights/bytes`` -- or ``skipped`` with the reason
   (no vLLM environment here, or a build without the collective transport);
5. **generation**: the ``hf`` engine (continuous batching, KV cache) in ``model.dtype``: ``--requests`` x
   ``--new-tokens`` sampled tokens, tokens/s.

Multi-rank NCCL needs more than one GPU: not checked here (the 2-rank code is tested on CPU with gloo).

Usage: ``PYTHONPATH=src python benchmarks/gpu_check.py`` (CUDA, bf16) or ``... --device cpu --tiny`` (the smoke
test). The last line is one JSON object; ``ok`` is true when every check that ran held (a skipped part is not a
failure: its ``skipped`` says why).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

LOSS_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa (~4e-3 relative per operation): the loss of a bf16 step vs fp32, relative."""
LOGPROB_ATOL = 5e-2
"""Mean |log-prob difference| of the last step's pre-update log-probs, bf16 vs fp32 (logits carry ~1e-2 of bf16
rounding over a 30-layer forward)."""
UPDATE_COSINE = 0.99
"""The bf16 update's direction against the fp32 one over all steps (AdamW's first steps are ~lr x sign(gradient): a
few small gradients flip sign under bf16 compute, the direction stays; fp32 masters keep updates far below bf16's
rounding step, which pure bf16 weights lose: cosine 0.44 measured on CPU, tests/train/test_train_masters.py)."""


def model_config(tiny: bool) -> Any:
    """SmolLM2-135M's architecture (``tiny``: 2 layers, 64 wide, vocabulary 512)."""
    from transformers import LlamaConfig

    if tiny:
        size = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        return LlamaConfig(**size, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, pad_token_id=2,
    )  # fmt: skip


def build(config: Any, dtype: str, device: str) -> torch.nn.Module:
    """The model from ``config`` with seed-0 random weights in ``dtype`` (``meta``: shapes only)."""
    from transformers import LlamaForCausalLM

    from psrl.models.builder import DTYPES

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta" if device == "meta" else "cpu"):
            model = LlamaForCausalLM(config)
    return model.to(DTYPES[dtype]).to(device if device != "meta" else "meta").eval()


def _batches(n: int, seqs: int, prompt: int, response: int, vocab: int) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(seqs)]
        responses = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(seqs)]
        out.append((prompts, responses, torch.randn(seqs, generator=g).tolist(), [[1.0] * response] * seqs))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train(worker: Any, batches: list[tuple], algo: Any, device: str) -> tuple[list[float], float, torch.Tensor]:
    """Every batch as a step (1 minibatch, no token budget); per step the model's loss on the batch before its
    update (the mean negative log-likelihood of the response tokens: it moves with the weights each step and with the
    precision, where the policy loss of a first minibatch is ~ the advantages' mean whatever both are: its ratio is
    1), the seconds of all steps but the first and the last step's pre-update log-probs."""
    from psrl.train.planner import plan
    from psrl.train.worker import StepInput, step_input

    losses, timed = [], 0.0
    for k, (prompts, responses, adv, masks) in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], 1, 1, None)
        old = worker.logprobs(StepInput(p, prompts, responses))
        behav = [[x - 0.01 for x in old[i]] for i in range(len(prompts))]
        m = worker.train_step(step_input(p, prompts, responses, old, behav, adv, masks, algo))
        _sync(device)
        timed += (time.perf_counter() - t0) if k > 0 else 0.0
        assert math.isfinite(float(m["train/loss"]))
        losses.append(-sum(x for i in old for x in old[i]) / sum(len(old[i]) for i in old))
    return losses, timed, torch.tensor([x for i in sorted(old) for x in old[i]])


def _flat(state: dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.as_tensor(state[k]).float().flatten() for k in sorted(state)])


def trainer_and_publish(ns: argparse.Namespace, config: Any, root: Path) -> dict[str, Any]:
    """Part 1 and 2 (module docstring)."""
    import torch.distributed as dist

    from psrl.config import AlgorithmConfig
    from psrl.models.builder import DTYPES
    from psrl.train.launch import free_port
    from psrl.train.worker import RankWorker, WorkerSpec

    algo = AlgorithmConfig()
    spec = WorkerSpec(build=functools.partial(build, config, "float32"), pad_id=2, algo=algo, lr=1e-5, device=ns.device)
    batches = _batches(ns.steps, ns.seqs, ns.prompt, ns.response, config.vocab_size)
    tokens = (ns.steps - 1) * ns.seqs * (ns.prompt + ns.response)
    runs: dict[str, tuple] = {}  # losses, seconds, last log-probs, start and end weights
    for name, dtype in (("fp32", "float32"), ("in_process", ns.dtype)):
        worker = RankWorker(replace(spec, build=functools.partial(build, config, dtype), dtype=dtype), 0, 1)
        start = _flat(worker.state() or {})
        losses, secs, logp = _train(worker, batches, algo, ns.device)
        runs[name] = (losses, secs, logp, start, _flat(worker.state() or {}))
        del worker
        print(f"{name}: losses {losses}, {secs:.2f} s", file=sys.stderr, flush=True)
    if ns.device.startswith("cuda"):
        torch.cuda.set_device(0)
    backend = "nccl" if ns.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    publish: list[tuple[float, int]] = []
    try:
        sharded = RankWorker(replace(spec, dtype=ns.dtype), 0, 1, shard=True)
        start = _flat(sharded.state() or {})
        losses, secs, logp = _train(sharded, batches, algo, ns.device)
        runs["fsdp"] = (losses, secs, logp, start, _flat(sharded.state() or {}))
        print(f"fsdp: losses {losses}, {secs:.2f} s", file=sys.stderr, flush=True)
        for v in range(1, ns.versions + 1):
            _sync(ns.device)
            t0 = time.perf_counter()
            version_dir = Path(sharded.publish(v, str(root / "weights"), 2, 256, DTYPES[ns.dtype])["path"])
            dt = time.perf_counter() - t0
            publish.append((dt, sum(f.stat().st_size for f in version_dir.iterdir())))
    finally:
        dist.destroy_process_group()
    ref_loss, _, ref_logp, ref_start, ref_w = runs["fp32"]
    ref_update = ref_w - ref_start
    out: dict[str, Any] = {}
    for name in ("in_process", "fsdp"):
        losses, secs, logp, start, w = runs[name]
        update = w - start
        logp_diff = float((logp - ref_logp).abs().mean())
        cos = float(torch.nn.functional.cosine_similarity(update, ref_update, dim=0))
        rel = max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(losses, ref_loss))
        out[name] = {
            "loss": losses,
            "loss_max_rel_diff_vs_fp32": rel,
            "logprob_mean_abs_diff_vs_fp32": logp_diff,
            "update_cosine_vs_fp32": cos,
            "weights_max_abs_diff_vs_fp32": float((w - ref_w).abs().max()),
            "train_tokens_per_s": tokens / secs if secs > 0 else math.nan,
            "ok": rel <= LOSS_RTOL and logp_diff <= LOGPROB_ATOL and cos >= UPDATE_COSINE,
        }
    out["fp32"] = {"loss": ref_loss, "train_tokens_per_s": tokens / runs["fp32"][1] if runs["fp32"][1] else math.nan}
    out["fsdp_vs_in_process_tokens_per_s_ratio"] = (
        out["fsdp"]["train_tokens_per_s"] / out["in_process"]["train_tokens_per_s"]
    )
    out["update_norm_fp32"] = float(ref_update.norm())
    out["publish_s"] = [s for s, _ in publish]
    out["publish_bytes"] = publish[-1][1] if publish else 0
    out["publish_gb_per_s"] = [b / s / 1e9 for s, b in publish]
    return out


def _trajectories_batch(version: int, ns: argparse.Namespace, vocab: int) -> Any:
    """A :class:`~psrl.staleness.Batch` of ``ns.seqs`` random trajectories (groups of 2) for :meth:`Trainer.step`."""
    from psrl.staleness import Batch
    from psrl.types import Trajectory

    g = torch.Generator().manual_seed(100 + version)
    groups = []
    for k in range(max(ns.seqs // 2, 1)):
        group = []
        for j in range(2):
            p = torch.randint(3, vocab, (ns.prompt,), generator=g).tolist()
            r = torch.randint(3, vocab, (ns.response,), generator=g).tolist()
            lp = (-10.0 - torch.rand(ns.response, generator=g)).tolist()
            traj = Trajectory(
                f"{k}-{j}", f"g{k}", version, p, r, lp, [1] * ns.response, [version] * ns.response, float(j)
            )
            group.append(traj)
        groups.append(group)
    return Batch(version, groups, [f"b{k}" for k in range(len(groups))], [version] * len(groups))


def sync(ns: argparse.Namespace, config: Any, root: Path) -> dict[str, Any]:
    """Part 3 (module docstring): per transport, seconds from the step's end until the engine serves the version."""
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models.policy import Policy
    from psrl.rollout.engines.hf import HFEngine
    from psrl.train import Trainer

    out: dict[str, Any] = {}
    for transport in ("memory", "files"):
        policy = Policy(build(config, ns.dtype, "cpu"), _Ids(2), device=ns.device, seed=0)
        engine = HFEngine(policy.replica(seed=1))
        work = root / f"sync-{transport}"
        trainer = Trainer(
            policy, AlgorithmConfig(), TrainerConfig(lr=1e-5), 1, work, dtype=ns.dtype, in_memory=transport == "memory"
        )
        try:
            seconds, nbytes = [], 0.0
            for v in range(ns.versions + 1):
                trainer.step(_trajectories_batch(v, ns, config.vocab_size))
                _sync(ns.device)
                step_end = time.perf_counter()
                nbytes = trainer.publish(v + 1)["weights/bytes"]
                asyncio.run(engine.update_weights(v + 1, trainer.out))
                _sync(ns.device)
                if v > 0:  # the first is warm-up
                    seconds.append(time.perf_counter() - step_end)
            assert engine.version == ns.versions + 1
        finally:
            trainer.close()
            asyncio.run(engine.close())
        out[transport] = {"sync_s": seconds, "bytes": nbytes, "sync_s_per_gb": [s / (nbytes / 1e9) for s in seconds]}
        print(f"sync {transport}: {seconds} s for {nbytes / 1e9:.3f} GB", file=sys.stderr, flush=True)
    return out


def collective_vllm(ns: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Part 4 (module docstring): a few steps of ``psrl train`` with vLLM engines fed by the collective transport
    over NCCL, or ``{"skipped": why}``."""
    from psrl.config import WeightsConfig
    from psrl.rollout.engines.vllm_server import EngineSetupError, find_vllm_python

    if not ns.device.startswith("cuda"):
        return {"skipped": "the collective transport over NCCL needs a GPU (--device cuda)"}
    if "transport" not in getattr(WeightsConfig, "__dataclass_fields__", {}):
        return {"skipped": "this build has no weights.transport key (the collective transport, issue #33 item 4)"}
    try:
        find_vllm_python(None)
    except EngineSetupError as e:
        return {"skipped": f"no vLLM environment here: {str(e).splitlines()[0]}"}
    run_dir = root / "collective-vllm"
    args = [
        "rollout.engine=vllm", "weights.transport=collective", "model.device=cuda", f"model.dtype={ns.dtype}",
        "psrl.staleness=0", "psrl.deployment.n_rollout_instances=1", f"trainer.total_steps={ns.vllm_steps}",
        "trainer.warm_start_steps=0", f"trainer.run_dir={run_dir}",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "psrl.cli", "train", *args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.vllm_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"psrl train did not finish within {ns.vllm_timeout} s", "args": args}
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr.strip().splitlines()[-1:], "args": args}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    synced = [r for r in rows if "time/sync_s" in r and r.get("weights/bytes")]
    per_gb = [r["time/sync_s"] / (r["weights/bytes"] / 1e9) for r in synced]
    return {"ok": len(rows) >= ns.vllm_steps and bool(per_gb), "steps": len(rows), "sync_s_per_gb": per_gb}


class _Ids:
    """The tokenizer a :class:`~psrl.models.Policy` needs for generation: its pad id only (token ids in and out)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id


async def _generate(engine: Any, contexts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from psrl.types import GenRequest

    await engine.generate(GenRequest(context=contexts[0], max_new_tokens=4))  # warm-up
    reqs = [GenRequest(context=c, max_new_tokens=new_tokens) for c in contexts]
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.generate(r) for r in reqs))
    dt = time.perf_counter() - t0
    await engine.close()
    return dt, sum(len(r.tokens) for r in reqs)


def generation(ns: argparse.Namespace, config: Any) -> dict[str, Any]:
    """Part 3 (module docstring)."""
    from psrl.models.policy import Policy
    from psrl.rollout.engines.hf import HFEngine
    from psrl.types import Sampling

    policy = Policy(build(config, ns.dtype, "cpu"), _Ids(2), device=ns.device, seed=0)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(3, config.vocab_size, (ns.prompt,), generator=g).tolist() for _ in range(ns.requests)]
    dt, n = asyncio.run(_generate(HFEngine(policy, sampling=Sampling(temperature=1.0)), contexts, ns.new_tokens))
    return {"gen_tokens": n, "gen_s": dt, "gen_tokens_per_s": n / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model instead of SmolLM2-135M's shape")
    p.add_argument("--steps", type=int, default=4, help="training steps (the first is warm-up, not timed)")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--versions", type=int, default=3, help="versions published")
    p.add_argument("--requests", type=int, default=32, help="generation requests (hf engine)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--vllm-steps", type=int, default=4, help="steps of the collective-into-vLLM run")
    p.add_argument("--vllm-timeout", type=int, default=240, help="seconds the collective-into-vLLM run may take")
    ns = p.parse_args(argv)
    if ns.steps < 2:
        p.error("--steps must be at least 2 (the first is warm-up)")
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible here (use --device cpu --tiny for a smoke run)")
    if not ns.device.startswith("cuda"):
        torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    config = model_config(ns.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        trained = trainer_and_publish(ns, config, Path(tmp))
        synced = sync(ns, config, Path(tmp))
        collective = collective_vllm(ns, Path(tmp))
    gen = generation(ns, config)
    gpu = torch.cuda.get_device_name(0) if ns.device.startswith("cuda") else None
    out = {
        "device": ns.device,
        "gpu": gpu,
        "torch": torch.__version__,
        "dtype": ns.dtype,
        "tiny": ns.tiny,
        "tokens_per_step": ns.seqs * (ns.prompt + ns.response),
        **trained,
        "sync": synced,
        "collective_vllm": collective,
        **gen,
        "wall_s": time.perf_counter() - started,
    }
    out["ok"] = bool(trained["fsdp"]["ok"] and trained["in_process"]["ok"] and collective.get("ok", True))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
