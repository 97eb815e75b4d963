"""The serving side: rollout instances (one engine each: weight sync, partial rollout, migration hand-back), the
pool that routes trajectories over them, the routers and the sync / migration strategies, and the session a
trajectory generates through. It drives engines and knows nothing of the protocol client (``tests/test_layers.py``).
"""

from psrl.rollout.serving.instance import InstanceRequest, RolloutInstance
from psrl.rollout.serving.pool import InstancePool
from psrl.rollout.serving.router import (
    CostModel,
    RandomRouter,
    RequestNumBalanceRouter,
    RoundRobinRouter,
    ThroughputOptimalRouter,
    build_router,
    fit_cost_model,
    load_cost_model,
    save_cost_model,
)
from psrl.rollout.serving.session import Session
from psrl.rollout.serving.sync import GreedySync, Migration, StatusBasedSync, build_migration, build_sync, indicator

__all__ = [
    "InstanceRequest",
    "RolloutInstance",
    "InstancePool",
    "Session",
    "RandomRouter",
    "RoundRobinRouter",
    "RequestNumBalanceRouter",
    "ThroughputOptimalRouter",
    "CostModel",
    "fit_cost_model",
    "load_cost_model",
    "save_cost_model",
    "build_router",
    "GreedySync",
    "StatusBasedSync",
    "Migration",
    "indicator",
    "build_sync",
    "build_migration",
]
