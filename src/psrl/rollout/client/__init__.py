"""The staleness-protocol client: the agent manager (reserve, launch N' members, complete, act on every status),
the proactive filter on STUCK buffers, and the bookkeeping (worker slots, counters, trajectory records)."""

from psrl.rollout.client.agents import AgentManager
from psrl.rollout.client.proactive import ProactiveFilter
from psrl.rollout.client.records import Counts, MemorySink, WorkerSlots, trajectory_record

__all__ = ["AgentManager", "ProactiveFilter", "Counts", "MemorySink", "WorkerSlots", "trajectory_record"]
