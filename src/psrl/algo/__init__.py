"""psrl.algo: the RL maths -- group advantages, policy losses, off-policy corrections, group filters.

Pure functions on padded ``[B, T]`` tensors with a ``mask`` of valid response tokens; nothing
here knows about rollout, Ray or the staleness manager (they depend on us, not the reverse).
"""

from psrl.algo.advantages import group_advantages, grpo_advantages
from psrl.algo.corrections import rollout_correction, rollout_correction_from_config
from psrl.algo.filters import DynamicSamplingFilter, build_group_filter
from psrl.algo.losses import aggregate, policy_loss

__all__ = [
    "grpo_advantages",
    "group_advantages",
    "rollout_correction",
    "rollout_correction_from_config",
    "aggregate",
    "policy_loss",
    "DynamicSamplingFilter",
    "build_group_filter",
]
