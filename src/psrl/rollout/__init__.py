"""The rollout side of psrl, in three rooms: ``engines`` (inference engines), ``serving`` (instances, pool, routing,
sync, sessions) and ``client`` (the staleness-protocol client: the agent manager). :func:`build_rollout` wires them
for a run; ``types`` holds the Protocols between the rooms; ``fakes`` the fake model, task and trainer of tests and
the simulator. Importing it loads neither torch nor an HTTP client.
"""

from psrl.rollout.build import build_rollout, sampling_of
from psrl.rollout.client import AgentManager, MemorySink
from psrl.rollout.engines import BatchingEngine, NoCacheEngine, TokenModel
from psrl.rollout.serving import InstancePool, RolloutInstance, Session
from psrl.rollout.types import (
    InFlight,
    InstanceFactory,
    InstanceStatus,
    Pool,
    RolloutStatus,
    Router,
    SyncStrategy,
    VersionProvider,
)

__all__ = [
    "build_rollout",
    "sampling_of",
    "AgentManager",
    "MemorySink",
    "BatchingEngine",
    "NoCacheEngine",
    "TokenModel",
    "InstancePool",
    "RolloutInstance",
    "Session",
    "Pool",
    "Router",
    "SyncStrategy",
    "VersionProvider",
    "InstanceFactory",
    "InstanceStatus",
    "InFlight",
    "RolloutStatus",
]
