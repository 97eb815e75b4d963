"""Off-policy rollout corrections in the decoupled form.

With staleness, the tokens were sampled by a *behaviour* policy (the rollout weights, version
``V_traj`` or later, possibly a different kernel) while the trainer's pre-update policy
(``old_logp``, the PPO proximal policy) is newer. The decoupled objective keeps the PPO ratio
against ``old_logp`` and corrects the sampling mismatch separately with

    rho_t = exp(old_logp_t - behav_logp_t).

* Truncated importance sampling (TIS): ``w_t = min(rho_t, C)`` (``token``) or
  ``w = min(prod_t rho_t, C)`` broadcast over the sequence (``sequence``). Truncation bounds
  the variance at the price of a bias towards the behaviour policy.
* Rejection sampling (RS): drop data whose ratio is outside ``[lo, hi]`` -- single tokens
  (``token``), whole sequences by the product of ratios (``sequence``) or by their geometric
  mean over valid tokens (``geometric``, length-independent). ``lo`` defaults to ``1 / hi``.

Everything is computed in float64 log space, so long sequences neither overflow nor
underflow; boundaries are inclusive (a ratio exactly at ``lo`` or ``hi`` is kept). A sequence
without valid tokens has product 1 and geometric mean 1 (empty product), so it is never the
cause of a NaN. Inputs are detached: the weights are constants of the loss.

Two batch-global corrections for high staleness (:func:`batch_corrections`), computed once over the
whole batch before the first minibatch, from the token log-ratios ``d_t = old_logp_t - behav_logp_t``
of :mod:`psrl.algo.divergence`:

* M2PO's second-moment masking (``m2po``, :func:`m2po_keep`);
* VCPO's ESS-scaled learning rate (``ess_lr``, :func:`ess_lr_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from psrl.algo.divergence import token_log_ratio, weight_sums

__all__ = [
    "rollout_correction",
    "rollout_correction_from_config",
    "IS_MODES",
    "RS_MODES",
    "batch_corrections",
    "m2po_keep",
    "sequence_ess",
    "ess_lr_scale",
]

IS_MODES = (None, "token", "sequence")
RS_MODES = (None, "token", "sequence", "geometric")
_METRIC_LOG_MAX = 20.0  # rho is clamped to e^20 for the rho_mean metric only, so it stays finite


def rollout_correction(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    *,
    is_mode: str | None = None,
    is_threshold: float = 2.0,
    rs_mode: str | None = None,
    rs_threshold: float = 2.0,
    rs_threshold_lower: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """IS weights and rejection mask for ``[B, T]`` log-probs; returns ``(weights, keep_mask, metrics)``.

    ``weights`` is 0 outside ``mask`` and, on valid tokens, the truncated IS weight (1 when
    ``is_mode`` is None). ``keep_mask`` is 1 for valid tokens that rejection sampling keeps
    (``keep_mask <= mask``). Both have the float dtype of ``old_logp`` (at least float32).
    The weight metrics are over kept tokens (those that reach the loss), ``rho_mean`` over all
    valid tokens; every metric is 0.0 when there is nothing to average.
    """
    _check_args(old_logp, behav_logp, mask, is_mode, is_threshold, rs_mode, rs_threshold, rs_threshold_lower)
    valid = mask.detach() > 0
    out_dtype = torch.promote_types(old_logp.dtype, torch.float32)
    log_rho = _log_rho(old_logp, behav_logp, valid)
    log_w, truncated = _is_log_weights(log_rho, is_mode, is_threshold)
    keep = valid & _rs_accept(log_rho, valid, rs_mode, rs_threshold, rs_threshold_lower)
    weights = torch.where(valid, log_w.exp(), torch.zeros_like(log_w)).to(out_dtype)
    metrics = _metrics(log_rho, weights.double(), valid, keep, truncated & keep)
    return weights, keep.to(out_dtype), metrics


def rollout_correction_from_config(
    old_logp: Tensor, behav_logp: Tensor, mask: Tensor, rc: Any
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """:func:`rollout_correction` with the settings of ``algorithm.rollout_correction``."""
    return rollout_correction(
        old_logp,
        behav_logp,
        mask,
        is_mode=rc.is_,
        is_threshold=rc.is_threshold,
        rs_mode=rc.rs,
        rs_threshold=rc.rs_threshold,
        rs_threshold_lower=rc.rs_threshold_lower,
    )


def _check_args(old_logp, behav_logp, mask, is_mode, is_threshold, rs_mode, rs_hi, rs_lo) -> None:
    """Reject bad modes and thresholds with the config key they come from."""
    if old_logp.shape != behav_logp.shape or old_logp.shape != mask.shape or old_logp.dim() != 2:
        raise ValueError(
            f"old_logp, behav_logp and mask must share one [B, T] shape, got "
            f"{tuple(old_logp.shape)}, {tuple(behav_logp.shape)}, {tuple(mask.shape)}"
        )
    if is_mode not in IS_MODES:
        raise ValueError(f"algorithm.rollout_correction.is: unknown mode {is_mode!r}, use one of {IS_MODES}")
    if rs_mode not in RS_MODES:
        raise ValueError(f"algorithm.rollout_correction.rs: unknown mode {rs_mode!r}, use one of {RS_MODES}")
    if not is_threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.is_threshold must be > 0, got {is_threshold}")
    if not rs_hi > 0:
        raise ValueError(f"algorithm.rollout_correction.rs_threshold must be > 0, got {rs_hi}")
    lo = 1.0 / rs_hi if rs_lo is None else rs_lo
    if not (0 < lo <= rs_hi):
        raise ValueError(
            f"algorithm.rollout_correction.rs_threshold_lower must be in (0, rs_threshold={rs_hi}], got {lo}"
        )


def _log_rho(old_logp: Tensor, behav_logp: Tensor, valid: Tensor) -> Tensor:
    """``log rho_t`` in float64, exactly 0 at padding (whatever garbage the padding holds)."""
    diff = old_logp.detach().double() - behav_logp.detach().double()
    return torch.where(valid, diff, torch.zeros_like(diff))


def _is_log_weights(log_rho: Tensor, mode: str | None, c: float) -> tuple[Tensor, Tensor]:
    """``(log w, truncated)``: ``log w = min(log rho, log C)`` per token or per sequence.

    Never exponentiates an unclamped ratio; ``truncated`` marks where the clamp is active.
    """
    if mode is None:
        return torch.zeros_like(log_rho), torch.zeros_like(log_rho, dtype=torch.bool)
    log_c = math.log(c)
    stat = log_rho if mode == "token" else log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)
    return stat.clamp(max=log_c), stat > log_c


def _rs_accept(log_rho: Tensor, valid: Tensor, mode: str | None, hi: float, lo: float | None) -> Tensor:
    """Boolean ``[B, T]``: True where rejection sampling keeps the token (bounds inclusive)."""
    if mode is None:
        return torch.ones_like(valid)
    log_hi = math.log(hi)
    log_lo = math.log(1.0 / hi if lo is None else lo)
    if mode == "token":
        stat = log_rho
    elif mode == "sequence":
        stat = log_rho.sum(dim=1, keepdim=True)
    else:  # geometric: mean log-ratio over valid tokens (0 for an empty sequence)
        count = valid.sum(dim=1, keepdim=True).clamp(min=1)
        stat = log_rho.sum(dim=1, keepdim=True) / count
    ok = (stat >= log_lo) & (stat <= log_hi)
    return ok.expand_as(valid)


def _masked_mean(x: Tensor, m: Tensor) -> float:
    """Mean of ``x`` where ``m``; 0.0 when nothing is selected (metrics must never be NaN)."""
    n = int(m.sum())
    return float(x[m].sum() / n) if n else 0.0


def _metrics(log_rho, weights, valid, keep, truncated) -> dict[str, float]:
    """Diagnostics over valid tokens (rho) and over kept tokens (the weights that reach the loss)."""
    n_valid = int(valid.sum())
    n_keep = int(keep.sum())
    rho = log_rho.clamp(max=_METRIC_LOG_MAX).exp()
    return {
        "correction/rho_mean": _masked_mean(rho, valid),
        "correction/is_weight_mean": _masked_mean(weights, keep),
        "correction/is_weight_max": float(weights[keep].max()) if n_keep else 0.0,
        "correction/is_truncated_frac": float(truncated.sum()) / n_keep if n_keep else 0.0,
        "correction/rs_masked_frac": (n_valid - n_keep) / n_valid if n_valid else 0.0,
    }


# ------------------------------------------------------------------ batch-global corrections (high staleness)


def batch_corrections(
    old_logp: Tensor, behav_logp: Tensor, mask: Tensor, rc: Any
) -> tuple[Tensor | None, float, dict[str, float]]:
    """``(keep, lr_scale, metrics)`` of ``algorithm.rollout_correction``'s ``m2po`` and ``ess_lr`` on a whole batch.

    ``keep`` (``[B, T]``, the dtype of ``mask``) is M2PO's mask, None when ``m2po`` is off; ``lr_scale`` multiplies
    the learning rate of the batch's optimiser steps (1.0 when ``ess_lr`` is off). A correction that is off adds
    no metric, so rows without them are unchanged.
    """
    d, valid = token_log_ratio(old_logp, behav_logp, mask)
    keep, lr_scale, metrics = None, 1.0, {}
    if rc.m2po:
        kept = m2po_keep(d, valid, rc.m2po_threshold)
        n = int(valid.sum())
        metrics["correction/m2po_masked_frac"] = (n - int(kept.sum())) / n if n else 0.0
        keep = kept.to(mask.dtype)
    if rc.ess_lr:
        lr_scale = ess_lr_scale(sequence_ess(d, valid), rc.ess_lr_min)
        metrics["correction/ess_lr_scale"] = lr_scale
    return keep, lr_scale, metrics


def m2po_keep(d: Tensor, valid: Tensor, tau: float) -> Tensor:
    """M2PO's second-moment token masking (Zheng et al., arXiv 2510.01161); boolean ``[B, T]``, True where kept.

    With ``M2(S) = sum_{t in S} d_t^2 / |S|`` over a set ``S`` of valid tokens, sort the valid tokens by
    ``d_t^2``, largest first, and mask the first ``k`` of them, ``k`` the smallest count for which the rest ``R``
    satisfies ``sum_{t in R} d_t^2 <= tau * |R|`` (that is, ``M2(R) <= tau``; the paper uses ``tau = 0.04``).
    Masked tokens get no gradient and leave the loss's denominators, as rejection-sampled ones do. Only extreme
    tokens are masked: nothing is when ``M2`` of the whole batch is already ``<= tau``. Ties are masked in
    row-major token order (a stable sort). If even the single smallest ``d_t^2`` exceeds ``tau`` every token is
    masked (the paper's loop "mask the largest while M2 > tau" run to its end; AReaL keeps one token instead).

    ``d`` is :func:`psrl.algo.divergence.token_log_ratio`'s: pre-update policy over behaviour, the ratio whose
    second moment is ``divergence/m2`` (AReaL's implementation takes the same pair of policies).
    """
    if not tau > 0:
        raise ValueError(f"algorithm.rollout_correction.m2po_threshold must be > 0, got {tau}")
    x = d[valid] ** 2
    n = x.numel()
    order = torch.sort(x, descending=True, stable=True).indices
    suffix = x[order].flip(0).cumsum(0).flip(0)  # suffix[i] = sum of the squares left after masking i tokens
    left = torch.arange(n, 0, -1, dtype=x.dtype, device=x.device)
    ok = (suffix <= tau * left).nonzero()
    k = int(ok[0]) if len(ok) else n
    kept = torch.ones(n, dtype=torch.bool, device=x.device)
    kept[order[:k]] = False
    out = torch.zeros_like(valid)
    out[valid] = kept
    return out


def sequence_ess(d: Tensor, valid: Tensor) -> float:
    """Normalised ESS of the batch's sequence importance weights, the statistic VCPO scales the step with:

        l_i = sum_t d_it (valid tokens of sequence i),  w_i = exp(l_i),  ESS = (sum_i w_i)^2 / (N sum_i w_i^2)

    over the ``N`` sequences holding a valid token (those that reach the loss). Computed shifted by ``max l_i``
    (:class:`psrl.algo.divergence.WeightSums`), so a long sequence's weight neither overflows nor underflows.
    """
    rows = valid.any(dim=1)
    return weight_sums(d.sum(dim=1)[rows]).ess


def ess_lr_scale(ess: float, floor: float) -> float:
    """VCPO's ESS-scaled step (Huang et al., arXiv 2602.17616): ``lr_t = lr * max(floor, sqrt(min(1, ESS)))``.

    ``ESS`` is :func:`sequence_ess`, over the whole batch, and the scale applies to the learning rate of every
    optimiser step on that batch. The learning rate, not the loss: AdamW divides each update by the running RMS
    of the gradient, so a loss multiplier would be all but cancelled. The square root is the rule for Adam-style
    optimisers, for which the step grows like the square root of the batch size: the batch counts as ``ESS * N``
    samples. This follows the authors' code (github.com/mit-han-lab/vcpo: ``compute_ess_info`` and
    ``ess_scaling`` with its defaults ``scaling_rule=sqrt``, ``base_ess_ratio=1``, unclipped weights), where the
    ESS is taken per optimiser minibatch; the paper's own formula could not be read through our search tool.
    The ``floor`` (``ess_lr_min``) is ours: VCPO's only floor is ``sqrt(1 / N)``, reached when one sequence holds
    all the weight.
    """
    if not 0 < floor <= 1:
        raise ValueError(f"algorithm.rollout_correction.ess_lr_min must be in (0, 1], got {floor}")
    return max(floor, math.sqrt(min(1.0, ess)))
