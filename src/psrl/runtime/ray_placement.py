"""Which Ray nodes serve the trainer and which the rollout instances (issue #37, item 1: pools).

``runtime.ray_pool_label`` names a Ray node label (``ray start --labels=psrl-pool=trainer``): the trainer's rank
actors go to nodes labelled ``<label>=trainer`` (a placement-group ``bundle_label_selector``), the rollout
instances' engine actors to nodes labelled ``<label>=rollout``, instance ``i`` pinned to the ``i % n``-th of the
``n`` rollout nodes (sorted by node id: two instances on two nodes land on two nodes). Without the key there are no
pools: ranks are packed wherever they fit and engine actors go where Ray puts them. PSRL's deployment keys say the
shape (``train_nnodes x train_ngpus_per_node`` ranks, ``n_rollout_instances``); :func:`check_pools` compares it
with the cluster as it is at start and makes an impossible placement one :class:`~psrl.errors.ConfigError` naming
the keys and what the cluster has.

A rollout node that comes back is used again (:class:`RolloutSeats`): at start a rollout node holds at most
``ceil(n_rollout_instances / n)`` instances (its *share*); an instance whose engine actor is gone (with its node,
or failed) may rejoin on an alive rollout node that holds fewer than that many other instances -- the node back
(Ray gives it a new node id), or another with room -- with a new engine actor there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from psrl.errors import ConfigError

if TYPE_CHECKING:
    from psrl.config import Config

__all__ = ["TRAINER", "ROLLOUT", "pool_nodes", "check_pools", "rollout_nodes", "pinned", "describe", "RolloutSeats"]

TRAINER = "trainer"
ROLLOUT = "rollout"


def pool_nodes(label: str) -> dict[str, list[dict]]:
    """The alive nodes by the value of their ``label`` ("" for a node without it), each list sorted by node id."""
    import ray

    pools: dict[str, list[dict]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            pools.setdefault(str(node.get("Labels", {}).get(label, "")), []).append(node)
    return {k: sorted(v, key=lambda n: n["NodeID"]) for k, v in pools.items()}


def describe(pools: dict[str, list[dict]], label: str) -> str:
    """What the cluster has, per pool: ``psrl-pool=trainer: 1 node (CPU 2, GPU 0); unlabelled: 1 node (...)``."""
    parts = []
    for value, nodes in sorted(pools.items()):
        cpu = sum(n.get("Resources", {}).get("CPU", 0.0) for n in nodes)
        gpu = sum(n.get("Resources", {}).get("GPU", 0.0) for n in nodes)
        name = f"{label}={value}" if value else "unlabelled"
        parts.append(f"{name}: {len(nodes)} node{'s' * (len(nodes) != 1)} (CPU {cpu:g}, GPU {gpu:g})")
    return "; ".join(parts) or "no alive node"


def check_pools(cfg: Config) -> None:
    """Raise one :class:`ConfigError` when ``cfg``'s shape cannot be placed on the pools of the cluster now: fewer
    trainer nodes than ``train_nnodes``, fewer CPUs (GPUs with ``model.device=cuda``) on them than ranks, no
    rollout node. Nothing to check without ``runtime.ray_pool_label``."""
    label = cfg.runtime.ray_pool_label
    if label is None:
        return
    d = cfg.psrl.deployment
    pools = pool_nodes(label)
    trainer, rollout = pools.get(TRAINER, []), pools.get(ROLLOUT, [])
    unit = "GPU" if cfg.model.device.startswith("cuda") else "CPU"
    have = sum(n.get("Resources", {}).get(unit, 0.0) for n in trainer)
    world = d.train_world_size
    problems = []
    if world > 1 and (len(trainer) < d.train_nnodes or have < world):
        problems.append(
            f"psrl.deployment.train_nnodes={d.train_nnodes} x train_ngpus_per_node={d.train_ngpus_per_node} asks "
            f"for {world} ranks of one {unit} on nodes labelled {label}={TRAINER}"
        )
    if not rollout:
        problems.append(
            f"psrl.deployment.n_rollout_instances={d.n_rollout_instances} needs at least one node labelled "
            f"{label}={ROLLOUT}"
        )
    if problems:
        raise ConfigError(
            "runtime.ray_pool_label",
            "; ".join(problems) + f", but the Ray cluster has {describe(pools, label)}",
            f"label nodes with ray start --labels={label}={TRAINER} / {label}={ROLLOUT}, or change the shape",
        )


def pinned(node: str) -> Any:
    """The scheduling strategy that puts an actor on ``node`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node, soft=False)


def rollout_nodes(label: str, n: int) -> list[str]:
    """The node id of each of ``n`` rollout instances at start: the alive rollout nodes in turn."""
    nodes = pool_nodes(label).get(ROLLOUT, [])
    if not nodes:
        raise ConfigError(
            "runtime.ray_pool_label", f"no alive node labelled {label}={ROLLOUT}", "label the rollout nodes"
        )
    return [nodes[i % len(nodes)]["NodeID"] for i in range(n)]


class RolloutSeats:
    """Which rollout node holds each instance's engine actor, and where an instance whose actor is gone may put a
    new one (see the module docstring). One per run, shared by its Ray engines
    (:class:`~psrl.runtime.ray_runtime.RayEngine`), used from their event loop only: :meth:`free` and :meth:`take` run with no ``await`` between them, so two
    instances never take the last room of a node.

    Args:
        label: ``runtime.ray_pool_label``.
        nodes: the node id of each instance's actor at start.
        spawn: ``spawn(index, node)`` makes instance ``index``'s engine actor on ``node``.
        attempts: new actors an instance may get over the run (``runtime.ray_rejoin_attempts``).
        every_s: how often an instance that wants one looks for room (``runtime.ray_rejoin_every_s``).
    """

    def __init__(self, label: str, nodes: list[str], spawn: Callable[[int, str], Any], attempts: int, every_s: float):
        self.label, self.nodes, self.spawn = label, list(nodes), spawn
        self.attempts, self.every_s = int(attempts), float(every_s)
        self.share = math.ceil(len(self.nodes) / max(1, len(set(self.nodes))))
        """The most instances a rollout node holds (as at start)."""

    def alive(self) -> list[str]:
        """The alive rollout nodes' ids, sorted (a GCS call: run it off the event loop)."""
        return [n["NodeID"] for n in pool_nodes(self.label).get(ROLLOUT, [])]

    def free(self, index: int, alive: list[str]) -> str | None:
        """The first of the ``alive`` rollout nodes that holds fewer than :attr:`share` instances besides
        ``index``, or None."""
        held = Counter(node for i, node in enumerate(self.nodes) if i != index)
        return next((node for node in alive if held[node] < self.share), None)

    def take(self, index: int, node: str) -> Any:
        """Instance ``index``'s new engine actor, on ``node``."""
        self.nodes[index] = node
        return self.spawn(index, node)
