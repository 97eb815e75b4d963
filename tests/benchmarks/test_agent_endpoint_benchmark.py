"""``benchmarks/agent_endpoint.py`` runs end to end (the built-in model, a tiny budget) and reports its ratio; its
two phases send the engine the same contexts."""

import asyncio
import importlib.util
import random
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from tests.benchmarks.run import run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


AGENTS_EXTRA = all(importlib.util.find_spec(m) for m in ("openai", "starlette", "uvicorn"))


@pytest.mark.skipif(not AGENTS_EXTRA, reason="the endpoint needs the agents extra: pip install -e '.[agents]'")
def test_the_benchmark_measures_both_paths_and_ends_with_the_ratio():
    out = run_benchmark(
        "agent_endpoint.py", "--model", "builtin", "--agents", "2", "--turns", "2", "--tokens", "4", "--pairs", "2"
    )
    assert out["direct_tokens_per_s"] > 0 and out["endpoint_tokens_per_s"] > 0
    assert out["engine"] == "hf" and out["hf_endpoint_over_direct"] == out["endpoint_over_direct"]
    assert out["pairs"] == 2 and isinstance(out["endpoint_cpu_ms_per_turn"], float)


class ContextEngine:
    """Answers each request by a rule of its context alone, recording every context: turns alternate between 3
    tokens and the stop token and the whole budget cut by length (every turn ends the context in more stop-token
    ids: one per turn, one per user turn). Two phases that send the same contexts record the same ones."""

    def __init__(self, token: int, stop: int):
        self.token, self.stop, self.contexts = token, stop, []

    def stops(self, req) -> bool:
        return (req.context.count(self.stop) // 2) % 2 == 0

    async def generate(self, req):
        self.contexts.append(list(req.context))
        stops = self.stops(req)
        req.tokens = [self.token] * 3 + [self.stop] if stops else [self.token] * req.max_new_tokens
        req.logprobs, req.versions = [0.0] * len(req.tokens), [0] * len(req.tokens)
        req.finish = "stop" if stops else "length"
        return req


@pytest.mark.parametrize("agents", [1, 5])
def test_direct_sends_the_contexts_the_endpoint_sends(tmp_path, agents):
    """The direct phase builds each next context as the endpoint renders it -- after a turn cut by length too,
    where the template's end-of-turn text follows the sampled tokens (before, the direct phase left it out, so the
    two phases sampled different continuations and different token counts)."""
    pytest.importorskip("uvicorn")
    import agent_endpoint as bench
    from psrl.tasks import get_task

    args = Namespace(model="builtin", agents=agents, turns=3, tokens=4, seed=0)
    cfg = bench._config(args, bench._rows(tmp_path / "rows.jsonl", args))
    task = get_task(cfg.task, seed=0, data=cfg.data)
    prompts = [task.sample_prompt(random.Random(i)) for i in range(agents)]

    async def play(phase):
        engine = ContextEngine(task.tokenizer.encode("a")[0], task.eos_id)
        try:
            return await phase(task, engine, prompts, 3, 4), sorted(engine.contexts)
        finally:
            await task.close()

    seen = {name: asyncio.run(play(phase)) for name, phase in bench.PHASES.items()}
    assert len(seen["direct"][1]) == 3 * agents
    engine = ContextEngine(task.tokenizer.encode("a")[0], task.eos_id)
    finishes = {engine.stops(Namespace(context=c)) for c in seen["direct"][1]}
    assert finishes == {True, False}, "the script should end turns both by the stop token and by length"
    assert seen["direct"] == seen["endpoint"]
