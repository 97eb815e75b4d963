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
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["rollout_correction", "rollout_correction_from_config", "IS_MODES", "RS_MODES"]

IS_MODES = (None, "token", "sequence")
RS_MODES = (None, "token", "sequence", "geometric")
_METRIC_LOG_MAX = 20.0  # rho is clamped to e^20 for the rho_mean metric only, so it stays finite


def rollout_correction(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    *,
    is_mode: Optional[str] = None,
    is_threshold: float = 2.0,
    rs_mode: Optional[str] = None,
    rs_threshold: float = 2.0,
    rs_threshold_lower: Optional[float] = None,
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


def _is_log_weights(log_rho: Tensor, mode: Optional[str], c: float) -> tuple[Tensor, Tensor]:
    """``(log w, truncated)``: ``log w = min(log rho, log C)`` per token or per sequence.

    Never exponentiates an unclamped ratio; ``truncated`` marks where the clamp is active.
    """
    if mode is None:
        return torch.zeros_like(log_rho), torch.zeros_like(log_rho, dtype=torch.bool)
    log_c = math.log(c)
    stat = log_rho if mode == "token" else log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)
    return stat.clamp(max=log_c), stat > log_c


def _rs_accept(log_rho: Tensor, valid: Tensor, mode: Optional[str], hi: float, lo: Optional[float]) -> Tensor:
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
