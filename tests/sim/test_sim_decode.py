"""``sim.decode``: the coordinator policy decodes on instances whose speed falls as their batch grows, so the
routing strategy changes the simulated answer (issue #11, item 4)."""

import pytest

from psrl.config import ConfigError, load_config
from psrl.sim import Workload, simulate
from psrl.sim.coordinator_policy import _engines

BASE = [
    "sim.decode.enable=true",
    "sim.decode.speeds=[1.0,0.2]",
    "sim.gen_time.dist=pareto",
    "sim.gen_time.alpha=1.5",
    "sim.gen_tokens_per_second=32",
    "sim.slots=16",
    "sim.steps=6",
    "sim.train_time=1.0",
    "psrl.staleness=1",
    "psrl.staleness_buffer_entries=4",
    "psrl.rollout_n=2",
    "psrl.deployment.n_rollout_instances=2",
    "psrl.partial_rollout.enable=true",
]


def run(*over):
    return simulate(Workload.from_config(load_config(None, BASE + list(over))), "coordinator")


def test_decode_speed_falls_as_the_batch_grows():
    """Engine of speed 0.5: a step over n rows takes (step_time + n row_time) / 0.5."""
    wl = Workload.from_config(load_config(None, BASE + ["sim.decode.speeds=[1.0,0.5]"]))
    slow = _engines(wl)[1]
    assert slow.step_cost + 4 * slow.token_cost == pytest.approx((0.02 + 4 * 0.002) / 0.5)
    per_request = [1 / (slow.step_cost + n * slow.token_cost) for n in (1, 4, 16)]
    assert per_request == sorted(per_request, reverse=True)


def test_throughput_optimal_beats_round_robin_on_unequal_instances():
    """Instance 1 decodes at a fifth of instance 0's speed: round_robin gives it half the trajectories,
    throughput_optimal (fitted online from the engines' figures) fewer; both keep the bound."""
    rr = run("psrl.routing_strategy.method=round_robin")
    to = run("psrl.routing_strategy.method=throughput_optimal")
    assert to.steps_per_hour > rr.steps_per_hour
    assert rr.violations == 0 and to.violations == 0 and to.staleness_max <= 1


def test_speeds_need_one_per_instance():
    with pytest.raises(ConfigError, match="sim.decode.speeds"):
        Workload.from_config(load_config(None, BASE + ["sim.decode.speeds=[1.0]"]))
