"""Policy losses (PPO, GSPO) with decoupled off-policy corrections, and loss aggregation.

All tensors are ``[B, T]`` padded, with ``mask`` (float or bool) marking valid response tokens.
The loss is the decoupled PPO objective

    L_t = -w_t * min(r_t A_t, clip(r_t, 1 - low, 1 + high) A_t)

where ``r`` is the ratio to the trainer's pre-update policy ``old_logp`` and ``w`` the
(detached) importance weight of :mod:`psrl.algo.corrections` that accounts for the behaviour
policy. Tokens rejected by rejection sampling are dropped from the loss *and* from the
aggregation denominators, exactly as if they had been padding.

GSPO replaces the token ratio by the sequence ratio ``s = exp(mean_t(logp_t - old_logp_t))``
with the token-level stop-gradient form of the GSPO paper,
``s_t = sg[s] * exp(logp_t - sg[logp_t])``: every ``s_t`` has the value ``s`` but its gradient
``s * grad logp_t`` flows through its own token, so per-token advantages remain possible and
with ``seq-mean-token-mean`` the gradient equals the sequence-level GSPO gradient. The
sequence ratio is much closer to 1 than token ratios, so GSPO is run with much smaller clip
ranges (the paper uses ``clip_ratio_low=3e-4, clip_ratio_high=4e-4``); the same config keys
are used, only their values differ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from psrl.algo.corrections import rollout_correction_from_config
from psrl.algo.divergence import LOG_RATIO_CLAMP

__all__ = [
    "aggregate",
    "policy_loss",
    "token_loss",
    "actor_sums",
    "actor_metrics",
    "ACTOR_SUMS",
    "AGG_MODES",
    "LOG_RATIO_CLAMP",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    * ``token-mean``: sum over valid tokens / number of valid tokens (long sequences weigh more);
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean;
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.

    Sequence means run over sequences with at least one valid token, so sequences that are all
    padding (or all rejected) neither dilute the loss nor produce 0/0; with no valid token at all
    the result is 0 (still connected to the graph, so ``backward`` works).
    """
    m = mask.to(loss_mat.dtype)
    masked = torch.where(m > 0, loss_mat * m, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if mode not in AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode: unknown mode {mode!r}, use one of {AGG_MODES}")
    count = m.sum(dim=1)
    seq = masked.sum(dim=1)
    if mode == "seq-mean-token-mean":
        seq = seq / count.clamp(min=1.0)
    has_tokens = (count > 0).to(loss_mat.dtype)
    return (seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    behav_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: Any,
) -> tuple[Tensor, dict[str, float]]:
    """The ``cfg.policy_loss`` (ppo | gspo) loss and its metrics; ``cfg`` is an ``AlgorithmConfig``.

    ``old_logp=None`` means the pre-update policy is the current one (a single minibatch):
    ``logp.detach()`` is used. ``behav_logp=None`` disables the rollout correction.
    ``advantages`` is per sequence ``[B]`` or per token ``[B, T]``.
    """
    old = logp.detach() if old_logp is None else old_logp.detach()
    per_token, eff, ratio, adv, metrics = _terms(logp, old, behav_logp, advantages, mask, cfg)
    loss = aggregate(per_token, eff, cfg.loss_agg_mode)
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    metrics.update(_loss_metrics(loss, ratio.detach(), adv, logp.detach() - old, eff > 0, low, high))
    return loss, metrics


def token_loss(
    logp: Tensor, old_logp: Tensor, behav_logp: Tensor | None, advantages: Tensor, mask: Tensor, cfg: Any
) -> tuple[Tensor, Tensor]:
    """``(per-token loss, effective mask)`` of :func:`policy_loss` before aggregation: a sharded trainer weighs the
    per-token loss with the batch's global denominators (:func:`psrl.train.planner.loss_weights` of the effective
    mask) and sums, so ``sum(weight * loss)`` over all ranks is ``policy_loss``'s value. Every term is per token
    or per sequence, so a subset of the rows gives the same values for those rows."""
    per_token, eff, _, _, _ = _terms(logp, old_logp.detach(), behav_logp, advantages, mask, cfg)
    return per_token, eff


ACTOR_SUMS = ("tokens", "clip_low", "clip_high", "ratio", "approx_kl")
"""What :func:`actor_sums` returns, in this order: sums that add up over ranks and micro-batches."""


@torch.no_grad()
def actor_sums(
    logp: Tensor, old_logp: Tensor, behav_logp: Tensor | None, advantages: Tensor, mask: Tensor, cfg: Any
) -> Tensor:
    """``actor/*`` of :func:`policy_loss` as sums over the rows given (:data:`ACTOR_SUMS`): a sharded trainer adds
    them over its micro-batches and ranks, then :func:`actor_metrics` divides, so the metrics are those of the
    whole minibatch."""
    old = old_logp.detach()
    _, eff, ratio, adv, _ = _terms(logp.detach(), old, behav_logp, advantages, mask, cfg)
    on = eff > 0
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    log_r = (logp.detach() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = log_r.exp() - 1.0 - log_r
    return torch.stack(
        [
            on.sum().float(),
            ((ratio < low) & (adv < 0) & on).sum().float(),
            ((ratio > high) & (adv > 0) & on).sum().float(),
            ratio[on].float().sum(),
            k3[on].float().sum(),
        ]
    )


def actor_metrics(sums: Tensor) -> dict[str, float]:
    """The ``actor/*`` metrics of :func:`actor_sums` added up (0 when no token is in the loss, as
    :func:`policy_loss` reports)."""
    n = float(sums[0])
    if n == 0:
        return {
            "actor/clip_frac_low": 0.0,
            "actor/clip_frac_high": 0.0,
            "actor/ratio_mean": 0.0,
            "actor/approx_kl": 0.0,
        }
    return {
        "actor/clip_frac_low": float(sums[1]) / n,
        "actor/clip_frac_high": float(sums[2]) / n,
        "actor/ratio_mean": float(sums[3]) / n,
        "actor/approx_kl": float(sums[4]) / n,
    }


def _terms(logp: Tensor, old: Tensor, behav_logp: Tensor | None, advantages: Tensor, mask: Tensor, cfg: Any):
    """Per-token ``-w * surrogate``, the effective mask (valid and kept), the ratio, the masked advantages and the
    correction metrics."""
    valid = mask.detach().to(logp.dtype)
    weights, keep, metrics = _correction(old, behav_logp, valid, cfg)
    eff = valid * keep
    adv = _broadcast_advantages(advantages, logp).detach()
    adv = torch.where(eff > 0, adv, torch.zeros_like(adv))  # padding may hold NaN advantages
    ratio = _ratio(logp, old, eff, cfg.policy_loss)
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    return -weights * surrogate, eff, ratio, adv, metrics


def _correction(old: Tensor, behav_logp: Tensor | None, valid: Tensor, cfg: Any):
    """IS weights and RS keep-mask; all ones and no metrics without behaviour log-probs.

    With ``behav_logp`` the correction metrics (``correction/rho_mean`` ...) are reported even
    when no correction is configured, so the rollout/trainer mismatch is always visible.
    """
    if behav_logp is None:
        return torch.ones_like(valid), torch.ones_like(valid), {}
    weights, keep, metrics = rollout_correction_from_config(old, behav_logp, valid, cfg.rollout_correction)
    return weights.to(valid.dtype), keep.to(valid.dtype), metrics


def _broadcast_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    """``[B]`` -> ``[B, T]`` (one advantage per sequence), ``[B, T]`` unchanged."""
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages.to(logp.dtype)[:, None].expand_as(logp)
    if advantages.shape == logp.shape:
        return advantages.to(logp.dtype)
    raise ValueError(f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}")


def _ratio(logp: Tensor, old: Tensor, eff: Tensor, kind: str) -> Tensor:
    """Per-token ratio: ``exp(logp - old)`` (ppo) or the stop-gradient sequence ratio (gspo).

    Padding positions get log-ratio 0 whatever they hold, so ``inf - inf`` never reaches the
    gradient (``torch.where`` routes no gradient to the unselected branch).
    """
    on = eff > 0
    log_r = torch.where(on, logp - old, torch.zeros_like(logp))
    if kind == "ppo":
        return log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if kind != "gspo":
        raise ValueError(f"algorithm.policy_loss: unknown loss {kind!r}, use ppo or gspo")
    seq_log_r = log_r.sum(dim=1, keepdim=True) / eff.sum(dim=1, keepdim=True).clamp(min=1.0)
    safe_logp = torch.where(on, logp, torch.zeros_like(logp))
    log_s = seq_log_r.detach() + safe_logp - safe_logp.detach()
    return log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _loss_metrics(loss, ratio, adv, log_r, on, low, high) -> dict[str, float]:
    """Clip fractions (tokens whose gradient the clip removes), mean ratio, approximate KL.

    ``approx_kl`` is the non-negative k3 estimator ``(r - 1) - log r`` of KL(old || new) (as in
    cleanrl), averaged over the tokens in the loss.
    """
    n = int(on.sum())
    if n == 0:
        zero = {"actor/clip_frac_low": 0.0, "actor/clip_frac_high": 0.0, "actor/ratio_mean": 0.0}
        return {"loss/policy": float(loss.detach()), **zero, "actor/approx_kl": 0.0}
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = log_r.exp() - 1.0 - log_r
    return {
        "loss/policy": float(loss.detach()),
        "actor/clip_frac_low": float(((ratio < low) & (adv < 0) & on).sum()) / n,
        "actor/clip_frac_high": float(((ratio > high) & (adv > 0) & on).sum()) / n,
        "actor/ratio_mean": float(ratio[on].mean()),
        "actor/approx_kl": float(k3[on].mean()),
    }
