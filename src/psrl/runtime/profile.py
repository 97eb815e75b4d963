"""Fit the ``throughput_optimal`` cost model from a short profiling run: ``psrl profile``.

For each instance's engine and each batch size ``n`` in ``sizes``, ``n`` requests of ``tokens``
tokens are generated together; ``n * tokens / elapsed`` is the engine's decode throughput at ``n``
running requests (KV use from ``load()`` where the engine reports it). :func:`psrl.rollout.serving.router.fit_cost_model`
turns the figures into the coefficients ``psrl.routing_strategy.cost_model_path`` reads::

    psrl profile [CONFIG] [key=value ...] --out cost_model.json
    psrl train psrl.routing_strategy.method=throughput_optimal psrl.routing_strategy.cost_model_path=cost_model.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from psrl.rollout.engines.base import as_engine
from psrl.rollout.serving.router import CostModel, fit_cost_model, save_cost_model
from psrl.types import GenRequest

__all__ = ["profile_engine", "main"]


async def profile_engine(
    engine: Any, sizes: Sequence[int] = (1, 2, 4, 8), tokens: int = 16, context: Sequence[int] = (1, 2, 3)
) -> list[tuple[int, float, float]]:
    """``(n, kv_usage, tokens_per_s)`` of ``engine`` (or a bare ``next_token`` model) at each batch size;
    the engine is started, not closed."""
    engine = as_engine(engine)
    await engine.start()
    loop = asyncio.get_running_loop()
    out = []
    for n in sizes:
        reqs = [GenRequest(list(context), int(tokens)) for _ in range(int(n))]
        t0 = loop.time()
        runs = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        kv = engine.load().kv_usage or 0.0
        await asyncio.gather(*runs)
        elapsed = max(loop.time() - t0, 1e-9)
        out.append((int(n), float(kv), sum(len(r.tokens) for r in reqs) / elapsed))
    return out


async def _profile_all(engines: Sequence[Any], sizes: Sequence[int], tokens: int) -> list[CostModel]:
    models = []
    try:
        for i, eng in enumerate(engines):
            samples = await profile_engine(eng, sizes, tokens)
            m = fit_cost_model(samples)
            if m is None:
                raise ValueError(f"instance {i}: need at least two batch sizes to fit a cost model")
            print(
                f"instance {i}: "
                + ", ".join(f"n={n}: {tps:.1f} tok/s" for n, _, tps in samples)
                + f"  ->  step = {m.k3:.4g}*n + {m.k4:.4g} (+ {m.k1:.4g}*kv) s",
                flush=True,
            )
            models.append(m)
    finally:
        for eng in engines:
            await eng.close()
    return models


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl profile", description=__doc__.split("\n\n")[0])
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]", help="the run's config and overrides")
    p.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    p.add_argument("--sizes", default="1,2,4,8", help="batch sizes to measure (default 1,2,4,8)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per request (default 16)")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    from psrl.config import load_config
    from psrl.runtime.engines import build_engines
    from psrl.train import build_task_and_policy

    args = list(ns.args)
    path = args.pop(0) if args and "=" not in args[0] else None
    cfg = load_config(path, args)
    task, policy = build_task_and_policy(cfg)
    engines = build_engines(cfg, policy, task)  # throughput does not depend on the weights' values
    sizes = [int(x) for x in ns.sizes.split(",") if x.strip()]
    models = asyncio.run(_profile_all(engines, sizes, ns.tokens))
    save_cost_model(ns.out, models)
    print(f"wrote {ns.out}: set psrl.routing_strategy.cost_model_path={ns.out}")
    return 0
