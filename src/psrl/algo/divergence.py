"""How far the trainer's pre-update policy is from the policy that sampled the batch.

On every valid (loss) token ``t`` of a batch, the token log-ratio and importance weight are

    d_t = old_logp_t - behav_logp_t,        w_t = exp(d_t) = pi_old(a_t | s_t) / pi_behav(a_t | s_t)

where ``old_logp`` is the trainer's pre-update policy (the PPO proximal policy, recomputed before the
first minibatch) and ``behav_logp`` the log-prob the engine recorded when it sampled the token. So
``d`` holds staleness and train-inference (engine) mismatch together. Over the ``n`` valid tokens:

* ``ess = (sum_t w_t)^2 / (n * sum_t w_t^2)``: the normalised effective sample size of the token
  weights, in ``(0, 1]``; 1 when every weight is equal (on-policy), ``1/n`` when one token holds
  all the weight;
* ``m2 = sum_t d_t^2 / n``: the second moment of the log-ratio, M2PO's statistic (arXiv 2510.01161);
* ``kl = sum_t (w_t - 1 - d_t) / n``: the k3 estimator of ``KL(pi_behav || pi_old)`` (the tokens are
  samples of the behaviour policy; each term is >= 0, and its mean is unbiased for that KL).

``d_t`` is clamped to ``+-LOG_RATIO_CLAMP`` first (as for ``actor/approx_kl``), so one wild token
gives a large finite value, never inf or NaN. Each statistic is a ratio of sums
(:class:`DivergenceSums`): a batch split over minibatches or trainer ranks adds its parts' sums with
:func:`reduce_sums` and takes the ratios once, so the figures are those of the whole batch.

Per staleness level ``k`` (``batch version - V_traj`` of the token's trajectory, the lag
``staleness/mean`` averages) the same three figures are reported as ``divergence/ess@s<k>`` ...,
with ``staleness/tokens@s<k>``, the fraction of the batch's valid tokens at that level.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "LOG_RATIO_CLAMP",
    "WeightSums",
    "DivergenceSums",
    "token_log_ratio",
    "weight_sums",
    "divergence_sums",
    "level_sums",
    "reduce_sums",
    "divergence_row",
    "divergence_metrics",
]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp, so a wild token gives a large finite ratio, not inf."""


@dataclass(frozen=True)
class WeightSums:
    """Sums of importance weights ``w_i = exp(l_i)``, kept as ``exp(shift) * s1`` and ``exp(2 shift) * s2`` so that
    sequence weights (``exp`` of a sum over hundreds of tokens) neither overflow nor underflow."""

    n: int = 0
    s1: float = 0.0
    """``sum_i exp(l_i - shift)``."""
    s2: float = 0.0
    """``sum_i exp(2 (l_i - shift))``."""
    shift: float = 0.0

    def __add__(self, other: WeightSums) -> WeightSums:
        if not other.n:
            return self
        if not self.n:
            return other
        top = max(self.shift, other.shift)
        a, b = math.exp(self.shift - top), math.exp(other.shift - top)
        return WeightSums(self.n + other.n, self.s1 * a + other.s1 * b, self.s2 * a * a + other.s2 * b * b, top)

    @property
    def ess(self) -> float:
        """``(sum w)^2 / (n sum w^2)``; 1.0 without weights (nothing is degenerate)."""
        return self.s1 * self.s1 / (self.n * self.s2) if self.n else 1.0


@dataclass(frozen=True)
class DivergenceSums:
    """Everything :func:`divergence_row` needs from a set of tokens: added across minibatches or ranks."""

    weights: WeightSums = field(default_factory=WeightSums)
    d2: float = 0.0
    """``sum_t d_t^2``."""
    k3: float = 0.0
    """``sum_t (exp(d_t) - 1 - d_t)``."""

    def __add__(self, other: DivergenceSums) -> DivergenceSums:
        return DivergenceSums(self.weights + other.weights, self.d2 + other.d2, self.k3 + other.k3)

    @property
    def n(self) -> int:
        return self.weights.n

    def stats(self) -> dict[str, float]:
        """``{"ess", "m2", "kl"}``; (1, 0, 0) without tokens."""
        n = self.n
        return {"ess": self.weights.ess, "m2": self.d2 / n if n else 0.0, "kl": self.k3 / n if n else 0.0}


def reduce_sums(parts: Iterable[DivergenceSums]) -> DivergenceSums:
    """The one reduction: the sums of a whole batch from those of its parts (minibatches, trainer ranks)."""
    total = DivergenceSums()
    for p in parts:
        total = total + p
    return total


def token_log_ratio(old_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(d, valid)``: ``d = clamp(old - behav, +-LOG_RATIO_CLAMP)`` in float64, 0 outside ``valid = mask > 0``."""
    if old_logp.shape != behav_logp.shape or old_logp.shape != mask.shape or old_logp.dim() != 2:
        raise ValueError(
            f"old_logp, behav_logp and mask must share one [B, T] shape, got {tuple(old_logp.shape)}, "
            f"{tuple(behav_logp.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.detach() > 0
    d = (old_logp.detach().double() - behav_logp.detach().double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(valid, d, torch.zeros_like(d)), valid


def weight_sums(log_w: Tensor) -> WeightSums:
    """:class:`WeightSums` of the weights ``exp(log_w)`` (a flat tensor), shifted by their largest log."""
    if log_w.numel() == 0:
        return WeightSums()
    shift = float(log_w.max())
    w = (log_w.double() - shift).exp()
    return WeightSums(int(log_w.numel()), float(w.sum()), float((w * w).sum()), shift)


def divergence_sums(d: Tensor, valid: Tensor) -> DivergenceSums:
    """:class:`DivergenceSums` of the valid tokens of a :func:`token_log_ratio` ``d``."""
    x = d[valid]
    return DivergenceSums(weight_sums(x), float((x * x).sum()), float((x.exp() - 1.0 - x).sum()))


def level_sums(d: Tensor, valid: Tensor, staleness: Tensor) -> dict[int, DivergenceSums]:
    """``{k: sums of the valid tokens of the rows whose staleness is k}``, for the levels holding valid tokens.
    ``staleness`` is ``[B]``: one level per trajectory (row)."""
    rows = staleness.to(valid.device).long()
    out = {}
    for k in sorted({int(s) for s in rows[valid.any(dim=1)].tolist()}):
        out[k] = divergence_sums(d, valid & (rows == k)[:, None])
    return out


def divergence_row(per_level: dict[int, DivergenceSums]) -> dict[str, float]:
    """The metric row from per-level sums (each added over ranks first): the batch's ``divergence/{ess,m2,kl}``,
    the same per level as ``...@s<k>``, and the token-weighted histogram ``staleness/tokens@s<k>``."""
    total = reduce_sums(per_level.values())
    row = {f"divergence/{name}": v for name, v in total.stats().items()}
    for k in sorted(per_level):
        row.update({f"divergence/{name}@s{k}": v for name, v in per_level[k].stats().items()})
        row[f"staleness/tokens@s{k}"] = per_level[k].n / total.n
    return row


def divergence_metrics(old_logp: Tensor, behav_logp: Tensor, mask: Tensor, staleness: Tensor) -> dict[str, float]:
    """:func:`divergence_row` of a ``[B, T]`` batch whose row ``i`` has staleness ``staleness[i]``."""
    d, valid = token_log_ratio(old_logp, behav_logp, mask)
    return divergence_row(level_sums(d, valid, staleness))
