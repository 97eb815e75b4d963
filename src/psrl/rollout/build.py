"""The rollout side of a run, built from its config: every wire between its parts is made here.

One engine per rollout instance; the pool builds the instances and is their listener; the sync strategy reads the
staleness manager's ``train_version``; the agent manager reserves through the staleness manager and generates
through the pool. The sampling settings take one route: :func:`sampling_of` is what every engine samples with
(:func:`psrl.runtime.engines.build_engines` builds the engines with it; a bare model is wrapped here with it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from psrl.rollout.client.agents import AgentManager
from psrl.rollout.engines.base import TokenModel, as_engine
from psrl.rollout.serving.instance import RolloutInstance
from psrl.rollout.serving.pool import InstancePool
from psrl.rollout.serving.router import build_router
from psrl.rollout.serving.sync import build_migration, build_sync
from psrl.types import Engine, Sampling, Sink, WeightSource

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.rollout.types import TrainerIdle
    from psrl.staleness import StalenessManager
    from psrl.tasks.base import Task

__all__ = ["build_rollout", "sampling_of"]


def sampling_of(cfg: Config, task: Task) -> Sampling:
    """How the run's engines sample: ``trainer.temperature``, ``trainer.top_p`` and the task's stop ids."""
    stop_ids = frozenset(int(t) for t in getattr(task, "stop_ids", ()))
    return Sampling(temperature=cfg.trainer.temperature, top_p=cfg.trainer.top_p, stop_ids=stop_ids)


def build_rollout(
    cfg: Config,
    engines: Sequence[Engine | TokenModel],
    store: WeightSource,
    manager: StalenessManager,
    *,
    task: Task,
    sink: Sink | None = None,
    log: Callable[[str], None] = print,
    trainer: TrainerIdle | None = None,
) -> tuple[InstancePool, AgentManager]:
    """The instance pool over ``engines`` and the agent manager that feeds ``manager`` from it.

    Args:
        cfg: the run's config (``psrl.*``, ``rollout.*``, the ``trainer.*`` sampling and seed, ``task.*`` retries).
        engines: one per rollout instance. A bare :class:`~psrl.rollout.engines.base.TokenModel` (a fake) is loaded
            with the store's newest version now and wrapped in the no-cache engine with :func:`sampling_of`;
            an engine loads at start.
        store: where the instances pull published weights.
        manager: the staleness manager (reserve / complete; its ``train_version`` for the sync strategy).
        task: prompts, episodes and rewards.
        sink: where trajectory records go.
        log: where engine failures are reported.
        trainer: the trainer loop's idle state, for the proactive filter's head scope
            (``psrl.proactive_filter_strategy.scope=head``).
    """
    p, rs = cfg.psrl, cfg.psrl.routing_strategy
    sampling = sampling_of(cfg, task)
    version, state = store.get()
    for model in engines:
        if not isinstance(model, Engine):
            model.load_weights(state, version)
    new_instance = functools.partial(
        RolloutInstance,
        weights=store,
        sync=build_sync(cfg, manager),
        log=log,
        partial_rollout=p.partial_rollout.enable,
        interrupt_as_prompt=p.partial_rollout.interrupt_as_prompt,
        max_new_tokens=cfg.trainer.max_new_tokens,
        max_restarts=cfg.rollout.max_restarts,
        max_batch=rs.max_concurrent_seqs_per_instance,
        multi_priority_queue=rs.enable_multi_priority_queue,
        request_sort=rs.request_sort_indicator,
    )
    pool = InstancePool(
        [as_engine(e, sampling) for e in engines],
        new_instance,
        build_router(cfg, cfg.trainer.seed),
        capacity=rs.max_concurrent_seqs_per_instance,
        candidate_sort=rs.candidate_sort_indicator,
        group_sticky=rs.enable_group_sticky,
        trajectory_sticky=rs.enable_trajectory_sticky,
        migration=build_migration(cfg),
    )
    agents = AgentManager(
        task,
        manager,
        pool,
        cfg,
        workers=len(pool.instances) * rs.max_concurrent_seqs_per_instance,
        sink=sink,
        trainer=trainer,
    )
    return pool, agents
