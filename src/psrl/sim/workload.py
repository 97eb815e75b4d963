"""The workload a simulation runs: slots, generation times, training and sync times, batch shape.

Built from the typed config (``sim.*`` and the ``psrl.*`` keys of ``psrl train``) by
:meth:`Workload.from_config`, so ``psrl simulate`` and ``psrl train`` read the same YAML.

The generation time of the i-th *launched* trajectory comes from one seeded stream
(:class:`GenTimeStream`), whatever the policy: every policy is judged on the same arrival of
work. A retry or a regenerated group simply takes the next value of the stream.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from psrl.config import AdaptiveStalenessConfig, Config, ConfigError
from psrl.sim.divergence import DivergenceModel
from psrl.sim.trace import load_trace, trace_train_time

__all__ = ["Workload", "GenTimeStream", "UniformStream"]

_CHUNK = 1 << 16


@dataclass(frozen=True)
class Workload:
    """Everything one simulation needs; plain data, so it pickles and prints."""

    slots: int = 64
    """Generation slots: trajectories generated at once."""
    steps: int = 100
    """Training steps to simulate."""
    staleness: int = 2
    """eta (``psrl.staleness``); the nominal bound every policy is asked to keep."""
    batch_size: int = 16
    """B: groups one training step consumes."""
    redundant_batch_size: int = 16
    """B': entries a psrl buffer holds (batch-level redundancy)."""
    group_size: int = 4
    """N: trajectories per group the algorithm needs."""
    redundant_group_size: int = 4
    """N': trajectories psrl launches per group (group-level redundancy)."""
    dist: str = "lognormal"
    """lognormal | pareto | constant | trace."""
    median: float = 1.0
    """Median generation time (lognormal, pareto) or the constant time."""
    sigma: float = 0.5
    """lognormal: sigma of log-time."""
    alpha: float = 1.5
    """pareto: tail index (> 1, so the mean is finite); the scale puts the median at ``median``."""
    trace: tuple[float, ...] | None = None
    """trace: generation seconds replayed in order (cycled)."""
    train_time: float = 1.0
    """Fixed seconds per training step."""
    train_time_per_token: float = 0.0
    """Extra training seconds per batch token."""
    tokens_per_second: float = 1.0
    """Tokens a trajectory produces per second of generation (its token count)."""
    sync_time: float = 0.0
    """Seconds from the end of a training step until generators hold the new weights."""
    filter_drop_rate: float = 0.0
    """Probability that the group filter drops a completed group."""
    proactive_method: str | None = None
    """psrl proactive filter on the last RESERVED entries of a STUCK buffer: None | retry | truncate."""
    proactive_threshold: int = 4
    """Act when the STUCK buffer has at most this many RESERVED entries."""
    proactive_scope: str = "window"
    """``psrl.proactive_filter_strategy.scope``: window = act on every STUCK buffer in [T, T+eta]; head = only on
    buffer T, and only while the trainer waits for it."""
    proactive_grace: float = 0.0
    """``psrl.proactive_filter_strategy.grace``: head scope acts only after the trainer has waited this many
    seconds for buffer T."""
    areal_max_concurrent_rollouts: int | None = None
    """areal: groups generating at once (None: B, AReaL's default)."""
    tinker_groups_per_batch: int | None = None
    """discard_requeue (Tinker): worker coroutines, one group each (None: B, as in Tinker)."""
    verl_staleness_threshold: float = 0.1
    """sample_budget (verl fully-async): async_training.staleness_threshold."""
    verl_trigger_parameter_sync_step: int = 4
    """sample_budget (verl fully-async): trainer steps between weight syncs."""
    verl_max_concurrent_samples: int = 16
    """sample_budget (verl fully-async): groups generating at once (16 per rollout server)."""
    seed: int = 0
    """Seed of the workload's random streams."""
    instances: int = 1
    """coordinator policy with decode: rollout instances (``psrl.deployment.n_rollout_instances``)."""
    routing: tuple = ()
    """coordinator policy with decode: ``(dotted key, value)`` pairs of ``psrl.routing_strategy``,
    ``psrl.partial_rollout`` and ``psrl.sync_and_mig_strategy``."""
    decode: bool = False
    """coordinator policy: decode tokens on instances whose speed falls as their batch grows (``sim.decode``)."""
    decode_step_time: float = 0.02
    decode_row_time: float = 0.002
    decode_speeds: tuple = ()
    decode_max_running: int | None = None
    divergence: DivergenceModel = DivergenceModel()
    """``sim.divergence``: each trained batch's lag -> ``divergence/*`` in the step rows."""
    adaptive: AdaptiveStalenessConfig = AdaptiveStalenessConfig()
    """``psrl.adaptive_staleness``: the psrl and coordinator policies move the bound under ``staleness`` (the
    ceiling) with psrl train's controller when ``adaptive.enable``."""

    @classmethod
    def from_config(cls, cfg: Config) -> Workload:
        """Read ``sim.*`` and ``psrl.*``; a trace is loaded here, once."""
        s, p = cfg.sim, cfg.psrl
        gt = s.gen_time
        trace = None
        train_time = s.train_time
        if gt.dist == "trace":
            if gt.trace is None:  # SimConfig.check() says so too; a Config built without it reaches here
                raise ConfigError("sim.gen_time.trace", "dist is trace but no file is given")
            trace = tuple(load_trace(gt.trace))
            measured = trace_train_time(gt.trace)
            if measured is not None:
                train_time = measured
        wl = cls(
            slots=s.slots,
            steps=s.steps,
            staleness=p.staleness,
            batch_size=p.batch_size,
            redundant_batch_size=p.redundant_batch_size,
            group_size=p.group_size,
            redundant_group_size=p.redundant_group_size,
            dist=gt.dist,
            median=gt.median,
            sigma=1.0 if gt.sigma is None else gt.sigma,
            alpha=gt.alpha,
            trace=trace,
            train_time=train_time,
            train_time_per_token=s.train_time_per_token,
            tokens_per_second=s.gen_tokens_per_second,
            sync_time=s.sync_time,
            filter_drop_rate=s.filter_drop_rate,
            proactive_method=p.proactive_filter_strategy.method,
            proactive_threshold=p.proactive_filter_strategy.threshold,
            proactive_scope=p.proactive_filter_strategy.scope,
            proactive_grace=p.proactive_filter_strategy.grace,
            areal_max_concurrent_rollouts=s.areal.max_concurrent_rollouts,
            tinker_groups_per_batch=s.tinker.groups_per_batch,
            verl_staleness_threshold=s.verl.staleness_threshold,
            verl_trigger_parameter_sync_step=s.verl.trigger_parameter_sync_step,
            verl_max_concurrent_samples=s.verl.max_concurrent_samples,
            seed=s.seed,
            instances=p.deployment.n_rollout_instances,
            routing=_routing(cfg),
            decode=s.decode.enable,
            decode_step_time=s.decode.step_time,
            decode_row_time=s.decode.row_time,
            decode_speeds=_speeds(s.decode.speeds),
            decode_max_running=s.decode.max_running,
            divergence=DivergenceModel(
                lr_scale=s.divergence.lr_scale,
                kl_coef=s.divergence.kl_coef,
                m2_coef=s.divergence.m2_coef,
                ess_coef=s.divergence.ess_coef,
            ),
            adaptive=p.adaptive_staleness,
        )
        return wl.check()

    def check(self) -> Workload:
        """Reject workloads the simulator cannot run, naming the key and the fix."""
        if self.decode_speeds and (len(self.decode_speeds) != self.instances or min(self.decode_speeds) <= 0):
            raise ConfigError(
                "sim.decode.speeds",
                f"needs {self.instances} positive numbers (one per instance), got {list(self.decode_speeds)}",
                "give one speed per psrl.deployment.n_rollout_instances, or [] for all 1.0",
            )
        if self.dist == "pareto" and self.alpha <= 1.0:
            raise ConfigError(
                "sim.gen_time.alpha",
                f"pareto tail index must be > 1 (finite mean), got {self.alpha}",
                "use e.g. alpha=1.5 for a heavy but finite tail",
            )
        if self.dist in ("lognormal", "pareto", "constant") and self.median <= 0:
            raise ConfigError("sim.gen_time.median", "must be > 0")
        if not 0.0 <= self.filter_drop_rate < 1.0:
            raise ConfigError(
                "sim.filter_drop_rate",
                f"must be in [0, 1), got {self.filter_drop_rate}",
                "a filter that drops every group never trains",
            )
        if self.train_time < 0 or self.sync_time < 0:
            raise ConfigError("sim.train_time", "train_time and sync_time must be >= 0")
        if self.proactive_scope not in ("window", "head"):
            raise ConfigError(
                "psrl.proactive_filter_strategy.scope", f"unknown value {self.proactive_scope!r}", "use window or head"
            )
        if self.proactive_grace < 0:
            raise ConfigError("psrl.proactive_filter_strategy.grace", "must be >= 0")
        if self.verl_trigger_parameter_sync_step < 1:
            raise ConfigError("sim.verl.trigger_parameter_sync_step", "must be >= 1")
        if self.verl_staleness_threshold < 0:
            raise ConfigError("sim.verl.staleness_threshold", "must be >= 0")
        for key, val in [
            ("sim.areal.max_concurrent_rollouts", self.areal_max_concurrent_rollouts),
            ("sim.tinker.groups_per_batch", self.tinker_groups_per_batch),
            ("sim.verl.max_concurrent_samples", self.verl_max_concurrent_samples),
        ]:
            if val is not None and val < 1:
                raise ConfigError(key, f"must be >= 1, got {val}")
        if self.steps < 1:
            raise ConfigError("sim.steps", "must be >= 1")
        if self.slots < self.redundant_group_size:
            raise ConfigError(
                "sim.slots",
                f"a group launches {self.redundant_group_size} trajectories at once but "
                f"there are only {self.slots} slots",
                "raise sim.slots or lower the group size",
            )
        if self.dist == "trace" and not self.trace:
            raise ConfigError("sim.gen_time.trace", "the trace holds no gen_seconds")
        return self

    def replace(self, **changes) -> Workload:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes).check()

    # ------------------------------------------------------------------ bounds

    def mean_gen_time(self) -> float:
        """Mean generation time of one trajectory (closed form; the trace's mean for a trace)."""
        if self.dist == "constant":
            return self.median
        if self.dist == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        if self.dist == "pareto":
            xm = self.median / 2 ** (1 / self.alpha)
            return self.alpha * xm / (self.alpha - 1)
        return float(np.mean(self._trace()))

    def _trace(self) -> tuple[float, ...]:
        """The replayed times of ``dist=trace``, the one distribution left (``check()`` made sure they are there)."""
        if self.trace is None:  # a Workload built by hand, unchecked: np.mean(None) used to fail here
            raise ConfigError(
                "sim.gen_time.dist",
                f"{self.dist!r} has no trace of generation times",
                "use lognormal, pareto or constant, or trace with sim.gen_time.trace",
            )
        return self.trace

    def mean_train_time(self) -> float:
        """Expected seconds of one step: fixed part + per-token part over the B*N trained trajectories."""
        tokens = self.batch_size * self.group_size * self.mean_gen_time() * self.tokens_per_second
        return self.train_time + self.train_time_per_token * tokens

    def generation_bound(self) -> float:
        """Steps/hour if every slot always generated useful work: a step needs B*N/(1-drop)
        trajectories of mean time m, and ``slots`` run at once, so slots*(1-drop)/(B*N*m) steps/s."""
        per_step = self.batch_size * self.group_size * self.mean_gen_time() / (1.0 - self.filter_drop_rate)
        return self.slots / per_step * 3600.0

    def trainer_bound(self) -> float:
        """Steps/hour if the trainer never waited: 3600 / expected step time."""
        t = self.mean_train_time()
        return math.inf if t <= 0 else 3600.0 / t

    def ideal_steps_per_hour(self) -> float:
        """min(generation bound, trainer bound): no policy can beat either."""
        return min(self.generation_bound(), self.trainer_bound())

    # ------------------------------------------------------------------ streams

    def gen_stream(self) -> GenTimeStream:
        """The generation time of the i-th launched trajectory, the same for every policy."""
        return GenTimeStream(self)

    def filter_stream(self) -> UniformStream:
        """Uniform numbers, the i-th for the i-th created group (filter decisions)."""
        return UniformStream(self.seed)


class GenTimeStream:
    """Draws generation times in chunks (fast) from a generator seeded by ``seed`` alone."""

    def __init__(self, wl: Workload):
        self._wl = wl
        self._rng = np.random.default_rng([wl.seed, 0])
        self._buf: list[float] = []
        self._pos = 0
        self._trace_pos = 0

    def _refill(self) -> None:
        wl = self._wl
        if wl.dist == "constant":
            arr = np.full(_CHUNK, wl.median)
        elif wl.dist == "lognormal":
            arr = self._rng.lognormal(math.log(wl.median), wl.sigma, _CHUNK)
        elif wl.dist == "pareto":
            xm = wl.median / 2 ** (1 / wl.alpha)
            arr = (self._rng.pareto(wl.alpha, _CHUNK) + 1.0) * xm
        else:
            trace = wl._trace()
            idx = (self._trace_pos + np.arange(_CHUNK)) % len(trace)
            self._trace_pos += _CHUNK
            arr = np.asarray(trace, dtype=float)[idx]
        self._buf = arr.tolist()
        self._pos = 0

    def next(self) -> float:
        """The next generation time."""
        if self._pos == len(self._buf):
            self._refill()
        v = self._buf[self._pos]
        self._pos += 1
        return v


class UniformStream:
    """Seeded uniforms in [0, 1), drawn in chunks."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng([seed, 1])
        self._buf: list[float] = []
        self._pos = 0

    def next(self) -> float:
        if self._pos == len(self._buf):
            self._buf = self._rng.random(_CHUNK).tolist()
            self._pos = 0
        v = self._buf[self._pos]
        self._pos += 1
        return v


def _speeds(value: Any) -> tuple:
    """``sim.decode.speeds`` as numbers, or a ConfigError naming the key."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return tuple(float(x) for x in value)
    except (TypeError, ValueError):
        raise ConfigError(
            "sim.decode.speeds",
            f"needs a list of numbers, got {value!r}",
            "give one relative speed per instance, e.g. sim.decode.speeds=[1.0,0.5]",
        ) from None


def _routing(cfg: Config) -> tuple:
    """The rollout-coordination keys the coordinator policy passes on, as plain ``(dotted key, value)`` pairs
    (the workload pickles): ``psrl.routing_strategy``, ``psrl.partial_rollout``, ``psrl.sync_and_mig_strategy``."""
    from psrl.config import config_to_dict

    p = config_to_dict(cfg.psrl)
    out = []
    for section in ("routing_strategy", "partial_rollout", "sync_and_mig_strategy"):
        stack = [(f"psrl.{section}", p[section])]
        while stack:
            prefix, node = stack.pop()
            for k, v in node.items():
                if isinstance(v, dict):
                    stack.append((f"{prefix}.{k}", v))
                elif k != "max_concurrent_seqs_per_instance":
                    out.append((f"{prefix}.{k}", v))
    return tuple(sorted(out))
