"""The ``sim.*`` sections: the workload of ``psrl simulate`` and the peer policies' own knobs."""

from __future__ import annotations

from dataclasses import dataclass

from psrl.config.fields import _f, _sub
from psrl.config.rules import require


@dataclass(frozen=True)
class GenTimeConfig:
    dist: str = _f(
        "lognormal", "lognormal | pareto | constant | trace.", choices=("lognormal", "pareto", "constant", "trace")
    )
    median: float = _f(1.0, "Median generation time of one trajectory (simulated seconds).", gt=0)
    sigma: float | None = _f(
        None,
        "lognormal: sigma of log-time (null = 1.0). Not used by pareto (see alpha).",
        ge=0,
        note="not with dist=pareto",
    )
    alpha: float = _f(1.5, "pareto: tail index alpha (> 1, so the mean is finite); smaller = heavier tail.", gt=1)
    trace: str | None = _f(
        None,
        "trace: a trajectories.jsonl whose timings are replayed.",
        path="file",
        note="only with sim.gen_time.dist=trace",
    )

    def check(self) -> None:
        """Each shape key belongs to one distribution: sigma to lognormal, alpha to pareto, trace to trace."""
        if self.dist == "pareto":
            require(
                self.sigma is None,
                "sim.gen_time.sigma",
                "is the lognormal shape; dist is pareto",
                "give pareto's tail index as sim.gen_time.alpha "
                f"(e.g. alpha={self.sigma if self.sigma and self.sigma > 1 else 1.5}) and drop sigma",
            )
        if self.dist == "trace":
            require(
                self.trace is not None,
                "sim.gen_time.trace",
                "dist is trace but no file is given",
                "set sim.gen_time.trace=path/to/trajectories.jsonl",
            )
        require(
            self.trace is None or self.dist == "trace",
            "sim.gen_time.trace",
            f"is set but sim.gen_time.dist is {self.dist!r}, so nothing would read it",
            "set sim.gen_time.dist=trace, or remove sim.gen_time.trace",
        )


@dataclass(frozen=True)
class ArealSimConfig:
    max_concurrent_rollouts: int | None = _f(
        None,
        "Groups generating at once (AReaL InferenceEngineConfig.max_concurrent_rollouts; "
        "null = consumer batch size B, AReaL's default). max_head_offpolicyness is psrl.staleness.",
        ge=1,
    )


@dataclass(frozen=True)
class TinkerSimConfig:
    groups_per_batch: int | None = _f(
        None,
        "Worker coroutines, each generating one group at a time (Tinker AsyncConfig.groups_per_batch; "
        "null = B, which is what it is in Tinker). max_steps_off_policy is psrl.staleness.",
        ge=1,
    )


@dataclass(frozen=True)
class VerlSimConfig:
    staleness_threshold: float = _f(
        0.1,
        "Extra samples per sync period: int(B * (staleness_threshold + 1) * trigger_parameter_sync_step) "
        "(verl async_training.staleness_threshold, default 0.1).",
        ge=0,
    )
    trigger_parameter_sync_step: int = _f(
        4, "Trainer steps between weight syncs (verl async_training.trigger_parameter_sync_step, default 4).", ge=1
    )
    max_concurrent_samples: int = _f(16, "Groups generating at once (verl: 16 per rollout server; one server).", ge=1)


@dataclass(frozen=True)
class SimDecodeConfig:
    enable: bool = _f(
        False,
        "coordinator policy only: model decoding on psrl.deployment.n_rollout_instances instances, routed by "
        "psrl.routing_strategy. A trajectory is (its generation time x sim.gen_tokens_per_second) tokens; an "
        "instance's decode step over n running requests takes (step_time + n x row_time) / speed, so each "
        "request slows as the batch grows.",
    )
    step_time: float = _f(0.02, "Seconds of one decode step whatever the batch (weights read once per step).", ge=0)
    row_time: float = _f(0.002, "Extra seconds per running request in a decode step.", gt=0)
    speeds: list = _f(
        [],
        "Relative speed of each instance (e.g. [1.0, 0.5]: a slower second machine); [] = all 1.0.",
        note="one positive number per instance, or []",
    )
    max_running: int | None = _f(
        None,
        "Requests an instance decodes at once (vLLM's max_num_seqs); the rest wait at the instance, where "
        "psrl.routing_strategy.enable_multi_priority_queue orders them. null: no limit.",
        ge=1,
    )


@dataclass(frozen=True)
class SimDivergenceConfig:
    lr_scale: float = _f(
        1.0,
        "Learning-rate-like factor of the divergence model: the drift per version of lag relative to the tiny "
        "model's (docs/learning.md); every divergence/* grows with (lr_scale x lag)^2. SmolLM2-135M is about 2.",
        ge=0,
    )
    kl_coef: float = _f(0.0036, "divergence/kl = kl_coef x mean over the batch of (lr_scale x lag)^2.", ge=0)
    m2_coef: float = _f(0.015, "divergence/m2 = m2_coef x mean over the batch of (lr_scale x lag)^2.", ge=0)
    ess_coef: float = _f(
        0.006, "divergence/ess = 1 / (1 + ess_coef x mean over the batch of (lr_scale x lag)^2).", ge=0
    )


@dataclass(frozen=True)
class SimConfig:
    slots: int = _f(64, "Generation slots (trajectories generated at once).", ge=1)
    steps: int = _f(100, "Training steps to simulate.", ge=1)
    gen_time: GenTimeConfig = _sub(GenTimeConfig, "Generation-time distribution of one trajectory.")
    train_time: float = _f(4.0, "Seconds per training step.", ge=0)
    train_time_per_token: float = _f(
        0.0, "Extra seconds per batch token (train time as a function of batch tokens).", ge=0
    )
    sync_time: float = _f(0.0, "Seconds a weight sync takes.", ge=0)
    filter_drop_rate: float = _f(
        0.0,
        "Probability the group filter drops a completed group.",
        ge=0,
        lt=1,
        fix="a filter that drops every group never trains: set sim.filter_drop_rate below 1",
    )
    gen_tokens_per_second: float = _f(
        1.0,
        "Tokens a trajectory produces per simulated second of generation (batch tokens for train_time_per_token).",
        gt=0,
    )
    decode: SimDecodeConfig = _sub(
        SimDecodeConfig, "Batching-dependent decode speed per instance (coordinator policy)."
    )
    divergence: SimDivergenceConfig = _sub(
        SimDivergenceConfig,
        "The divergence model: each trained batch's lag -> divergence/ess, /m2, /kl in the simulated step rows "
        "(what psrl.adaptive_staleness reads; docs/simulate.md). Defaults fitted to docs/learning.md's tiny model.",
    )
    areal: ArealSimConfig = _sub(ArealSimConfig, "The areal policy: AReaL's own knobs (defaults: AReaL's).")
    tinker: TinkerSimConfig = _sub(TinkerSimConfig, "The discard_requeue policy: the Tinker cookbook's knobs.")
    verl: VerlSimConfig = _sub(
        VerlSimConfig, "The sample_budget policy (verl fully-async) and one_step_off: verl's knobs."
    )
    seed: int = _f(0, "Seed of the workload's random stream (the same for every policy).", ge=0)

    def check(self) -> None:
        self.gen_time.check()
