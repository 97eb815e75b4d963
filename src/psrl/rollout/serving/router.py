"""Routers: which rollout instance a trajectory (or one of its turns) goes to (``psrl.routing_strategy``).

Routers only choose among *eligible* instances, those whose version is ``>= V_traj`` of the
trajectory and that have room (fewer than ``max_concurrent_seqs_per_instance`` trajectories; the
pool filters them, :mod:`psrl.rollout.serving.pool`), so routing can never make a segment older than its
trajectory. The pool hands candidates over sorted by ``candidate_sort_indicator``; a router that
sees a tie keeps the first.

* ``random``: a seeded uniform choice.
* ``round_robin``: the next eligible instance in turn.
* ``request_num_balance``: the fewest running trajectories.
* ``throughput_optimal``: the largest marginal gain of estimated decode throughput (below).

**Cost model** (PSRL's "waterfall" form). One decode step of an instance running ``n`` requests at
KV-cache use ``kv`` takes ``k1*kv + max(k2, k3*n) + k4`` seconds and yields ``n`` tokens, so its
throughput is ``T(n) = n / step(n)``. Adding a request to instance ``i`` gains ``T_i(n_i+1) - T_i(n_i)``;
the router picks the largest gain (zero once the instance runs its ``max_batch``: more only wait; among
saturated instances, the one whose backlog ``(running + 1) / T`` drains first).
``delta_throughput_threshold`` (PSRL's meaning): an instance whose
gain has fallen below that fraction of its gain when idle (``T_i(1)``) is skipped while another is not.
The coefficients come from ``routing_strategy.cost_model_path`` (JSON written by ``psrl profile``) or,
with no file, are fitted online from the engines' own figures (:class:`psrl.types.EngineLoad`:
running requests, tokens/s, KV use) by least squares with ``k2 = 0``; until an instance has been seen
at two different loads it is treated as the others' average, so the router starts as request-number
balancing.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psrl.config import Config
    from psrl.rollout.serving.instance import RolloutInstance
    from psrl.rollout.types import Router

__all__ = [
    "RandomRouter",
    "RoundRobinRouter",
    "RequestNumBalanceRouter",
    "ThroughputOptimalRouter",
    "CostModel",
    "fit_cost_model",
    "load_cost_model",
    "save_cost_model",
    "build_router",
]


class RandomRouter:
    """A seeded uniform choice among the candidates."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def pick(self, candidates: Sequence[RolloutInstance], n_instances: int) -> RolloutInstance:
        if not candidates:
            raise ValueError("RandomRouter: no candidate instance")
        return candidates[self.rng.randrange(len(candidates))]


class RoundRobinRouter:
    """Cycle through the instances; skip the ineligible ones."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[RolloutInstance], n_instances: int) -> RolloutInstance:
        by_index = {inst.index: inst for inst in candidates}
        for k in range(n_instances):
            idx = (self._next + k) % n_instances
            if idx in by_index:
                self._next = idx + 1
                return by_index[idx]
        raise ValueError("RoundRobinRouter: no candidate instance")


class RequestNumBalanceRouter:
    """The candidate with the fewest running trajectories (the first on ties)."""

    def pick(self, candidates: Sequence[RolloutInstance], n_instances: int) -> RolloutInstance:
        if not candidates:
            raise ValueError("RequestNumBalanceRouter: no candidate instance")
        return min(candidates, key=lambda inst: inst.running)


class CostModel:
    """Step time ``k1*kv + max(k2, k3*n) + k4`` of one instance (see the module docstring)."""

    __slots__ = ("k1", "k2", "k3", "k4")

    def __init__(self, k1: float = 0.0, k2: float = 0.0, k3: float = 1.0, k4: float = 0.0):
        self.k1, self.k2, self.k3, self.k4 = float(k1), float(k2), float(k3), float(k4)

    def step_time(self, n: int, kv: float = 0.0) -> float:
        return self.k1 * kv + max(self.k2, self.k3 * n) + self.k4

    def throughput(self, n: int, kv: float = 0.0) -> float:
        """Tokens per second at ``n`` running requests (0 at ``n = 0``)."""
        return n / max(self.step_time(n, kv), 1e-12) if n > 0 else 0.0

    def gain(self, n: int, kv: float = 0.0) -> float:
        """Marginal throughput of one more request."""
        return self.throughput(n + 1, kv) - self.throughput(n, kv)

    def as_dict(self) -> dict:
        return {"k1": self.k1, "k2": self.k2, "k3": self.k3, "k4": self.k4}


def fit_cost_model(samples: Sequence[tuple[int, float, float]]) -> CostModel | None:
    """Least-squares fit of ``step = k1*kv + k3*n + k4`` (``k2 = 0``) to ``(n, kv, tokens_per_s)`` samples.

    A sample's step time is ``n / tokens_per_s``. None until the samples hold two different ``n``.
    """
    import numpy as np

    rows = [(n, kv, tps) for n, kv, tps in samples if n > 0 and tps > 0]
    if len({n for n, _, _ in rows}) < 2:
        return None
    n = np.array([r[0] for r in rows], dtype=float)
    kv = np.array([r[1] for r in rows], dtype=float)
    y = n / np.array([r[2] for r in rows], dtype=float)
    cols = [n, np.ones_like(n)] + ([kv] if np.ptp(kv) > 0 else [])
    coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)
    k3, k4 = max(float(coef[0]), 1e-9), max(float(coef[1]), 0.0)
    k1 = max(float(coef[2]), 0.0) if len(coef) > 2 else 0.0
    return CostModel(k1=k1, k2=0.0, k3=k3, k4=k4)


def save_cost_model(path: str | Path, models: Sequence[CostModel]) -> None:
    """Write ``{"instances": [{k1..k4}, ...]}``, what ``routing_strategy.cost_model_path`` reads."""
    Path(path).write_text(
        json.dumps({"form": "step = k1*kv + max(k2, k3*n) + k4", "instances": [m.as_dict() for m in models]}, indent=1)
        + "\n"
    )


def load_cost_model(path: str | Path) -> list[CostModel]:
    """The per-instance models of a cost-model file (``{"instances": [...]}`` or one ``{k1..k4}`` for all)."""
    from psrl.errors import ConfigError

    key = "psrl.routing_strategy.cost_model_path"
    try:
        data = json.loads(Path(path).read_text())
        items = data["instances"] if isinstance(data, dict) and "instances" in data else [data]
        return [CostModel(**{k: float(v) for k, v in item.items() if k in CostModel.__slots__}) for item in items]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            key,
            f"cannot read a cost model from {path} ({type(e).__name__}: {e})",
            "give the JSON file psrl profile writes, or null to fit the model online",
        ) from e


class ThroughputOptimalRouter:
    """The candidate with the largest marginal gain of estimated decode throughput."""

    def __init__(self, models: Sequence[CostModel] | None = None, delta_threshold: float = 0.5, max_samples: int = 256):
        self.fixed = list(models) if models else None
        self.delta_threshold = float(delta_threshold)
        self.max_samples = int(max_samples)
        self.samples: dict[int, list[tuple[int, float, float]]] = {}
        self.fitted: dict[int, CostModel] = {}

    def model(self, inst: RolloutInstance) -> CostModel | None:
        if self.fixed is not None:
            return self.fixed[inst.index % len(self.fixed)]
        return self.fitted.get(inst.index)

    def observe(self, inst: RolloutInstance) -> None:
        """Record the instance's own load figures; refit its model when they show a new load."""
        if self.fixed is not None:
            return
        ld = inst.load()
        if ld.running <= 0 or ld.tokens_per_s <= 0:
            return
        s = self.samples.setdefault(inst.index, [])
        s.append((int(ld.running), float(ld.kv_usage or 0.0), float(ld.tokens_per_s)))
        del s[: -self.max_samples]
        m = fit_cost_model(s)
        if m is not None:
            self.fitted[inst.index] = m

    def pick(self, candidates: Sequence[RolloutInstance], n_instances: int) -> RolloutInstance:
        if not candidates:
            raise ValueError("ThroughputOptimalRouter: no candidate instance")
        for inst in candidates:
            self.observe(inst)
        models = {inst.index: self.model(inst) for inst in candidates}
        known = [m for m in models.values() if m is not None]
        if not known:
            return min(candidates, key=lambda inst: inst.running)
        avg = CostModel(*(sum(getattr(m, k) for m in known) / len(known) for k in CostModel.__slots__))
        scored = []
        for inst in candidates:
            m = models[inst.index] or avg
            kv = inst.load().kv_usage or 0.0
            gain = m.gain(inst.running, kv)
            limit = getattr(inst, "max_batch", None)
            if limit is not None and inst.running >= limit:
                gain = 0.0  # the engine decodes at most max_batch at once: one more only waits
            n = inst.running if limit is None else min(inst.running + 1, limit)
            drain = (inst.running + 1) / max(m.throughput(max(n, 1), kv), 1e-12)  # time to serve its backlog
            scored.append((gain >= self.delta_threshold * m.gain(0, kv), gain, -drain, inst))
        # above the threshold first, then the gain, then (all saturated) the shortest backlog; first on ties
        return max(scored, key=lambda t: t[:3])[3]


def build_router(cfg: Config, seed: int = 0) -> Router:
    """The router ``psrl.routing_strategy`` names."""
    from psrl.errors import ConfigError

    rs = cfg.psrl.routing_strategy
    method = rs.method
    if method == "random":
        return RandomRouter(seed)
    if method == "round_robin":
        return RoundRobinRouter()
    if method == "request_num_balance":
        return RequestNumBalanceRouter()
    if method == "throughput_optimal":
        models = load_cost_model(rs.cost_model_path) if rs.cost_model_path else None
        return ThroughputOptimalRouter(models, rs.delta_throughput_threshold)
    raise ConfigError(
        "psrl.routing_strategy.method",
        f"unknown router {method!r}",
        "use random, round_robin, request_num_balance or throughput_optimal",
    )
