"""``psrl.adaptive_staleness``: psrl's own keys (not PSRL's) for the controller that moves the staleness bound.

``psrl.staleness`` stays the hard ceiling; the controller (:mod:`psrl.runtime.adaptive`) sets the bound
new reservations use within ``[min, psrl.staleness]`` from what each step measures. The default limits are
what ``docs/learning.md`` measured on the agentic task with the preset's corrections at staleness 2, the
largest fixed bound at parity with sync (5 seeds, run means ``divergence/ess`` 0.97-0.98, ``/m2`` 0.026-0.052,
``/kl`` 0.011-0.017), with room for the noise of a 4-step window. Limits set between staleness 2 and 4
(0.93 / 0.15 / 0.04, the first defaults) let the controller climb to 4-5, where learning broke on 2 of 5 seeds
before the window means showed it ("The adaptive bound on real runs").
"""

from __future__ import annotations

from dataclasses import dataclass

from psrl.config.fields import _f
from psrl.config.rules import require


@dataclass(frozen=True)
class AdaptiveStalenessConfig:
    enable: bool = _f(
        False,
        "Let the controller set the bound of new reservations within [min, psrl.staleness] from the measured "
        "trainer idle time and divergence (docs/staleness.md); off: the bound is psrl.staleness throughout.",
    )
    min: int = _f(0, "The lowest bound the controller sets.", ge=0)
    start: int = _f(
        1,
        "The bound the controller starts at, taken into [min, psrl.staleness]. 1: a bound at parity with sync on "
        "every task measured, so the first windows do not run at sync speed (docs/learning.md); 0 starts synchronous.",
        ge=0,
    )
    every: int = _f(
        4,
        "Steps between moves: the controller judges this many step rows, then moves up one or down about half.",
        ge=1,
    )
    idle_frac: float = _f(
        0.2,
        "Raise the bound when the trainer spent at least this fraction of the window waiting for its buffer "
        "((time/step_s - time/train_s - time/publish_s) / time/step_s) and the divergence is inside its limits.",
        gt=0,
        le=1,
    )
    ess_min: float = _f(0.95, "Lower the bound when the window's mean divergence/ess falls below this.", ge=0, le=1)
    m2_max: float = _f(0.08, "Lower the bound when the window's mean divergence/m2 rises above this.", gt=0)
    kl_max: float = _f(0.025, "Lower the bound when the window's mean divergence/kl rises above this.", gt=0)

    def check(self, ceiling: int) -> None:
        """``min`` within the ceiling ``psrl.staleness``."""
        require(
            not self.enable or self.min <= ceiling,
            "psrl.adaptive_staleness.min",
            f"is {self.min}, above psrl.staleness ({ceiling}), the ceiling the controller moves under",
            f"set psrl.adaptive_staleness.min <= {ceiling}, or raise psrl.staleness",
        )
