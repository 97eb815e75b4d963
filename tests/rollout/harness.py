"""Build the REAL coordinator (or its parts) on fake engines / tasks / trainer, for virtual-time tests."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from psrl.config import load_config
from psrl.rollout.client.records import MemorySink
from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.fakes import FakeEngine, FakeTask, FakeTrainer
from psrl.rollout.serving.instance import RolloutInstance
from psrl.rollout.serving.pool import InstancePool
from psrl.rollout.serving.router import RoundRobinRouter
from psrl.rollout.serving.sync import GreedySync
from psrl.runtime.coordinator import Coordinator
from psrl.runtime.local import build
from psrl.runtime.vloop import run_virtual

BASE = {
    "psrl.staleness": 1,
    "psrl.staleness_buffer_entries": 2,
    "psrl.rollout_n": 2,
    "psrl.deployment.n_rollout_instances": 2,
    "psrl.routing_strategy.max_concurrent_seqs_per_instance": 4,
}


def config(**overrides: Any):
    """A validated Config: BASE plus ``overrides`` given with '__' for '.' (psrl__staleness=0)."""
    items = dict(BASE)
    items.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(None, [f"{k}={_yaml(v)}" for k, v in items.items()])


def _yaml(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def coordinator(
    cfg,
    task: FakeTask | None = None,
    *,
    token_cost: float = 0.01,
    sync_cost: float = 0.0,
    train_time: float = 0.5,
    sink: Any = None,
    record: bool = False,
    log: Any = None,
    on_event: Any = None,
    on_bound: Any = None,
) -> Coordinator:
    """The real Coordinator, built by psrl train's builder, with FakeEngine instances, a FakeTask and a FakeTrainer."""
    task = task if task is not None else FakeTask()
    engines = [
        FakeEngine(token_cost=token_cost, sync_cost=sync_cost, record=record)
        for _ in range(cfg.psrl.deployment.n_rollout_instances)
    ]
    return build(
        cfg,
        log=log or (lambda _: None),
        task=task,
        trainer=FakeTrainer(train_time=train_time),
        engines=engines,
        sink=sink if sink is not None else MemorySink(),
        on_event=on_event,
        on_bound=on_bound,
    )


def pool_of(
    models: list, store: Any, sync: Any = None, router: Any = None, pool: dict | None = None, **instance: Any
) -> InstancePool:
    """Real rollout instances over fake ``models`` (each in the no-cache engine) sharing ``store``; ``instance``:
    their settings (partial_rollout, max_batch, ...), ``pool``: the pool's (capacity, candidate_sort, ...)."""
    new = functools.partial(RolloutInstance, weights=store, sync=sync or GreedySync(), **instance)
    return InstancePool([NoCacheEngine(m) for m in models], new, router or RoundRobinRouter(), **(pool or {}))


def stub_pool(stubs: list, router: Any, **kw: Any) -> InstancePool:
    """A pool over stand-in instances (``SimpleNamespace`` with what the pool and routers read), unwired."""
    return InstancePool(stubs, lambda _index, stub, **_listeners: stub, router, **kw)


def run(coord: Coordinator, steps: int, on_step: Any = None) -> list[dict]:
    """Run ``steps`` training steps on the virtual-time loop (``on_step``: called with each step's row)."""
    return run_virtual(coord.run(steps, on_step))


def statuses(records: list[dict]) -> Counter:
    return Counter(r["status"] for r in records)


def check_bound(records: list[dict], eta: int) -> int:
    """Assert the staleness guarantees on trajectory records; returns how many were trained."""
    trained = [r for r in records if r["status"] == "trained"]
    for r in trained:
        assert r["consumed_version"] - r["v_traj"] <= eta, r
        assert r["consumed_version"] >= r["v_traj"], r
        if r["segment_versions"]:
            assert min(r["segment_versions"]) >= r["v_traj"], r
            assert max(r["segment_versions"]) <= r["consumed_version"], r
    return len(trained)
