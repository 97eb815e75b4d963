"""psrl.sim: a discrete-event simulator of asynchronous RL training, in simulated time.

It answers "what throughput, what staleness, what waste" for a workload before a cluster is
rented, and runs psrl's Reserve / Occupy / Consume protocol (the real
:class:`psrl.staleness.StalenessManager`) side by side with the staleness policies of other
systems on exactly the same arrival of work.

    from psrl.sim import Workload, simulate
    res = simulate(Workload(slots=64, batch_size=16, group_size=4, sigma=0.5), "psrl")
    res.ratio_to_ideal, res.violations, res.length_bias
"""

from __future__ import annotations

from psrl.sim.baselines import Areal, DiscardRequeue, OneStepOff, SampleBudget, Sync
from psrl.sim.coordinator_policy import CoordinatorPolicy
from psrl.sim.engine import Engine, Group, SimulationStuck
from psrl.sim.metrics import JSON_KEYS, Result
from psrl.sim.psrl_policy import PsrlPolicy
from psrl.sim.workload import Workload

__all__ = [
    "POLICIES",
    "DEFAULT_POLICIES",
    "Workload",
    "Result",
    "JSON_KEYS",
    "Engine",
    "Group",
    "SimulationStuck",
    "simulate",
    "compare",
]

POLICIES: dict[str, type] = {
    "psrl": PsrlPolicy,
    "sync": Sync,
    "one_step_off": OneStepOff,
    "areal": Areal,
    "discard_requeue": DiscardRequeue,
    "sample_budget": SampleBudget,
    "coordinator": CoordinatorPolicy,
}
# What a comparison runs unless told otherwise: psrl and the five other systems' policies.
# ``coordinator`` (psrl train's real coordinator in virtual time, ~0.1 ms per trajectory) checks
# the ``psrl`` model and is run on request (``--policies psrl,coordinator``).
DEFAULT_POLICIES: tuple[str, ...] = ("psrl", "sync", "one_step_off", "areal", "discard_requeue", "sample_budget")


def simulate(wl: Workload, policy: str) -> Result:
    """Run one policy (a key of :data:`POLICIES`) on one workload."""
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}") from None
    return cls(wl).run()


def compare(wl: Workload, policies: list[str] | None = None) -> list[Result]:
    """Every policy (default: :data:`DEFAULT_POLICIES`) on the same workload and the same random stream."""
    return [simulate(wl, p) for p in (policies or list(DEFAULT_POLICIES))]
