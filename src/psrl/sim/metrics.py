"""What a simulation measures, and the one result record every policy returns.

Definitions (also in ``docs/simulate.md``):

* A trajectory is *resolved* when it was trained, or its completed output was thrown away
  (filtered, surplus, stale, rejected), or it was cancelled mid-generation. Work still in
  flight or waiting in a buffer when the simulation stops is neither trained nor discarded:
  it is left out of every ratio below (an end-of-run artefact, not the policy's doing).
* ``staleness`` of a trained trajectory = consumed version - its V_traj.
* ``discarded_fraction`` = generation seconds of completed-but-discarded trajectories over the
  generation seconds of all resolved completed ones.
* ``wasted_fraction`` (table only) = slot seconds that trained nothing (discarded plus cancelled
  partial generations) over all resolved slot seconds.
* ``length_bias`` = mean generation time of trained trajectories (a truncated one counts with the
  time it ran) over the mean full generation time of all resolved ones (a cancelled or truncated
  one counts with the time it would have taken): below 1.0 means slow problems are
  under-represented in training, or trained on cut-off outputs.
* Rates and idle fractions are measured from the end of warm-up (the first 10% of the steps, at
  least one) to the end of the last step, so the one-off pipeline fill is excluded; staleness,
  discard and bias count every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Recorder", "Result", "JSON_KEYS", "percentile_from_hist", "warmup_steps"]

JSON_KEYS = (
    "policy",
    "staleness",
    "steps_per_hour",
    "ideal_steps_per_hour",
    "ratio_to_ideal",
    "trainer_idle",
    "generator_idle",
    "staleness_mean",
    "staleness_p99",
    "staleness_max",
    "violations",
    "discarded_fraction",
    "length_bias",
)


@dataclass
class Result:
    """One policy on one workload."""

    policy: str
    staleness: int
    steps_per_hour: float
    ideal_steps_per_hour: float
    ratio_to_ideal: float
    trainer_idle: float
    generator_idle: float
    staleness_mean: float
    staleness_p99: int
    staleness_max: int
    violations: int
    discarded_fraction: float
    length_bias: float
    wasted_fraction: float = 0.0
    trained_trajectories: int = 0
    launched_trajectories: int = 0
    sim_seconds: float = 0.0
    seconds_per_step: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Exactly the keys ``psrl simulate --json`` promises."""
        d = asdict(self)
        return {k: d[k] for k in JSON_KEYS}


def percentile_from_hist(hist: list[int], q: float) -> int:
    """Smallest value s with at least q of the mass at or below s (numpy's 'inverted_cdf')."""
    total = sum(hist)
    if total == 0:
        return 0
    need = q * total
    run = 0
    for s, c in enumerate(hist):
        run += c
        if run >= need - 1e-9 * total:
            return s
    return len(hist) - 1


class Recorder:
    """Accumulates per-trajectory outcomes and per-step timings; cheap enough for 1M trajectories."""

    def __init__(self, slots: int, eta: int):
        self.slots = slots
        self.eta = eta
        self.hist: list[int] = [0] * (eta + 2)
        self.trained_n = 0
        self.trained_drawn = 0.0
        self.trained_slot = 0.0
        self.discarded_n = 0
        self.discarded_drawn = 0.0
        self.discarded_slot = 0.0
        self.cancelled_n = 0
        self.cancelled_drawn = 0.0
        self.cancelled_slot = 0.0
        self.step_ends: list[float] = []
        self.step_durations: list[float] = []
        self.slot_integral_at_end: list[float] = []

    def trained(self, staleness: int, drawn: float, slot_seconds: float) -> None:
        """A trajectory went into a training batch."""
        hist = self.hist
        if staleness >= len(hist):
            hist.extend([0] * (staleness + 1 - len(hist)))
        hist[staleness] += 1
        self.trained_n += 1
        self.trained_drawn += drawn
        self.trained_slot += slot_seconds

    def discarded(self, drawn: float, slot_seconds: float) -> None:
        """A completed trajectory was thrown away (filtered, surplus, stale, rejected)."""
        self.discarded_n += 1
        self.discarded_drawn += drawn
        self.discarded_slot += slot_seconds

    def cancelled(self, drawn: float, slot_seconds: float) -> None:
        """A generation was stopped before it finished (passive abort, N' surplus, retry)."""
        self.cancelled_n += 1
        self.cancelled_drawn += drawn
        self.cancelled_slot += slot_seconds

    def step_done(self, t: float, duration: float, slot_integral: float) -> None:
        """A training step ended at t after ``duration`` seconds of training."""
        self.step_ends.append(t)
        self.step_durations.append(duration)
        self.slot_integral_at_end.append(slot_integral)

    # ------------------------------------------------------------------ summary

    def result(self, policy: str, ideal: float, launched: int) -> Result:
        """Fold the counters into a :class:`Result` (definitions in the module docstring)."""
        ends = self.step_ends
        w = warmup_steps(len(ends))
        if len(ends) > w:
            window = ends[-1] - ends[w - 1]
            steps = len(ends) - w
            busy_train = sum(self.step_durations[w:])
            busy_slots = self.slot_integral_at_end[-1] - self.slot_integral_at_end[w - 1]
        else:
            window, steps = ends[-1], len(ends)
            busy_train, busy_slots = sum(self.step_durations), self.slot_integral_at_end[-1]
        sph = steps * 3600.0 / window if window > 0 else float("inf")
        n = self.trained_n
        mean_s = sum(s * c for s, c in enumerate(self.hist)) / n if n else 0.0
        smax = max((s for s, c in enumerate(self.hist) if c), default=0)
        completed_gen = self.trained_slot + self.discarded_slot
        resolved_n = n + self.discarded_n + self.cancelled_n
        resolved_drawn = self.trained_drawn + self.discarded_drawn + self.cancelled_drawn
        all_slot = completed_gen + self.cancelled_slot
        bias = (self.trained_slot / n) / (resolved_drawn / resolved_n) if n and resolved_drawn > 0 else 1.0
        return Result(
            policy=policy,
            staleness=self.eta,
            steps_per_hour=sph,
            ideal_steps_per_hour=ideal,
            ratio_to_ideal=sph / ideal if ideal > 0 else 0.0,
            trainer_idle=_clip01(1.0 - busy_train / window) if window > 0 else 0.0,
            generator_idle=_clip01(1.0 - busy_slots / (self.slots * window)) if window > 0 else 0.0,
            staleness_mean=mean_s,
            staleness_p99=percentile_from_hist(self.hist, 0.99),
            staleness_max=smax,
            violations=sum(self.hist[self.eta + 1 :]),
            discarded_fraction=self.discarded_slot / completed_gen if completed_gen > 0 else 0.0,
            length_bias=bias,
            wasted_fraction=(self.discarded_slot + self.cancelled_slot) / all_slot if all_slot > 0 else 0.0,
            trained_trajectories=n,
            launched_trajectories=launched,
            sim_seconds=ends[-1],
            seconds_per_step=window / steps if steps else 0.0,
        )


def warmup_steps(steps: int) -> int:
    """Steps left out of rates and idle fractions: the first 10% (at least one), the pipeline fill."""
    return max(1, steps // 10)


def _clip01(x: float) -> float:
    """Idle fractions are in [0, 1]; float round-off can leave -1e-16."""
    return min(1.0, max(0.0, x))
