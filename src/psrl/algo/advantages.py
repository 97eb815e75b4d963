"""Group-relative advantages (GRPO).

Every trajectory of a group answers the same prompt, so the group mean reward is a baseline
that needs no value network: ``A_i = r_i - mean(r)``, optionally divided by the group std.

The std is the **population** std (``unbiased=False``, divide by ``N``): it is defined for a
group of one (std 0, advantage 0, no NaN) and it makes the normalised advantages of every
group have unit second moment, whatever the group size. ``eps`` is added to the std so a
group with identical rewards gets advantage exactly 0 rather than 0/0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

__all__ = ["grpo_advantages", "group_advantages", "ADV_ESTIMATORS"]


def grpo_advantages(rewards: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of ``rewards[G, N]`` (G groups of N trajectories): ``(r - mean) / (std + eps)``.

    With ``norm_by_std=False`` only the mean is removed (Dr. GRPO style, no per-group rescaling,
    so groups with a small reward spread are not up-weighted).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, N], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return centred
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return centred / (std + eps)


def group_advantages(
    groups_rewards: Sequence[Sequence[float]], norm_by_std: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """The same advantages for groups of different sizes (plain floats in, plain floats out).

    Groups can be ragged when redundant rollout or retries leave some groups with more members;
    each group uses only its own members. An empty group gives an empty list.
    """
    return [_one_group(list(map(float, g)), norm_by_std, eps) for g in groups_rewards]


def _one_group(rewards: list[float], norm_by_std: bool, eps: float) -> list[float]:
    """GRPO advantages of one group, in float64 so results do not depend on the group size."""
    if not rewards:
        return []
    n = len(rewards)
    mean = math.fsum(rewards) / n
    centred = [r - mean for r in rewards]
    if not norm_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]


ADV_ESTIMATORS = {"grpo": group_advantages}
"""``algorithm.adv_estimator`` -> its function; the config's choices for that key must list exactly these."""
