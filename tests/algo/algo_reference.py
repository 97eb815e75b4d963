"""Slow, obvious twins of psrl.algo: pure-Python loops over lists (values) and per-token torch
loops (gradients). The fast vectorised code is checked equal to these on random inputs."""

from __future__ import annotations

import math

import torch

# ------------------------------------------------------------------ advantages


def ref_group_adv(rewards: list[float], norm: bool, eps: float) -> list[float]:
    n = len(rewards)
    mean = 0.0
    for r in rewards:
        mean += r / n
    out = [r - mean for r in rewards]
    if norm:
        var = 0.0
        for r in rewards:
            var += (r - mean) ** 2 / n  # population variance
        out = [a / (math.sqrt(var) + eps) for a in out]
    return out


# ------------------------------------------------------------------ aggregation


def ref_aggregate(loss: list[list[float]], mask: list[list[float]], mode: str) -> float:
    if mode == "token-mean":
        total, count = 0.0, 0
        for row, mrow in zip(loss, mask):
            for x, m in zip(row, mrow):
                if m:
                    total += x
                    count += 1
        return total / count if count else 0.0
    per_seq = []
    for row, mrow in zip(loss, mask):
        vals = [x for x, m in zip(row, mrow) if m]
        if not vals:
            continue  # sequences without valid tokens do not count
        per_seq.append(sum(vals) / len(vals) if mode == "seq-mean-token-mean" else sum(vals))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


# ------------------------------------------------------------------ corrections


def ref_correction(old, behav, mask, is_mode, c, rs_mode, hi, lo):
    """(weights, keep) as lists of lists; ratios multiplied out in plain floats."""
    lo = 1.0 / hi if lo is None else lo
    weights, keep = [], []
    for o_row, b_row, m_row in zip(old, behav, mask):
        rhos = [math.exp(o - b) for o, b, m in zip(o_row, b_row, m_row) if m]
        prod = 1.0
        for r in rhos:
            prod *= r
        geo = prod ** (1.0 / len(rhos)) if rhos else 1.0
        w_row, k_row = [], []
        for o, b, m in zip(o_row, b_row, m_row):
            if not m:
                w_row.append(0.0)
                k_row.append(0.0)
                continue
            rho = math.exp(o - b)
            w = 1.0 if is_mode is None else min(rho, c) if is_mode == "token" else min(prod, c)
            stat = {None: 1.0, "token": rho, "sequence": prod, "geometric": geo}[rs_mode]
            ok = rs_mode is None or (lo <= stat <= hi)
            w_row.append(w)
            k_row.append(1.0 if ok else 0.0)
        weights.append(w_row)
        keep.append(k_row)
    return weights, keep


# ------------------------------------------------------------------ policy loss


def ref_ppo_token_losses(logp, old, adv, weights, low, high):
    """Per-token PPO loss list of lists in plain floats (adv per token)."""
    out = []
    for lp_row, o_row, a_row, w_row in zip(logp, old, adv, weights):
        row = []
        for lp, o, a, w in zip(lp_row, o_row, a_row, w_row):
            r = math.exp(lp - o)
            clipped = min(max(r, 1 - low), 1 + high)
            row.append(-w * min(r * a, clipped * a))
        out.append(row)
    return out


def ref_gspo_token_losses(logp, old, adv, weights, eff, low, high):
    out = []
    for lp_row, o_row, a_row, w_row, m_row in zip(logp, old, adv, weights, eff):
        diffs = [lp - o for lp, o, m in zip(lp_row, o_row, m_row) if m]
        s = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        clipped = min(max(s, 1 - low), 1 + high)
        out.append([-w * min(s * a, clipped * a) for a, w in zip(a_row, w_row)])
    return out


def torch_loop_loss(logp: torch.Tensor, old, adv, weights, eff, low, high, kind: str, mode: str):
    """The loss built token by token with scalar torch ops, for autograd reference gradients.

    GSPO uses the paper's token-level stop-gradient form written out per token.
    """
    B, T = logp.shape
    seq_terms, total, count = [], logp.new_zeros(()), 0
    for b in range(B):
        idx = [t for t in range(T) if eff[b][t]]
        if not idx:
            continue
        if kind == "gspo":
            s = torch.exp(sum(logp[b, t] - old[b][t] for t in idx) / len(idx))
        terms = []
        for t in idx:
            if kind == "ppo":
                r = torch.exp(logp[b, t] - old[b][t])
            else:
                r = s.detach() * torch.exp(logp[b, t] - logp[b, t].detach())
            a = adv[b][t]
            clipped = torch.clamp(r, 1 - low, 1 + high)
            un, cl = r * a, clipped * a
            terms.append(-weights[b][t] * (un if un.item() <= cl.item() else cl))
        seq_sum = sum(terms)
        total = total + seq_sum
        count += len(idx)
        seq_terms.append(seq_sum / len(idx) if mode == "seq-mean-token-mean" else seq_sum)
    if mode == "token-mean":
        return total / max(count, 1)
    return sum(seq_terms) / len(seq_terms) if seq_terms else logp.sum() * 0.0


def gspo_sequence_level_loss(logp: torch.Tensor, old, adv_seq, eff, low, high):
    """GSPO as the paper states it: one clipped term per sequence with s = exp(mean log-ratio)."""
    B, T = logp.shape
    terms = []
    for b in range(B):
        idx = [t for t in range(T) if eff[b][t]]
        if not idx:
            continue
        s = torch.exp(sum(logp[b, t] - old[b][t] for t in idx) / len(idx))
        a = adv_seq[b]
        un, cl = s * a, torch.clamp(s, 1 - low, 1 + high) * a
        terms.append(-(un if un.item() <= cl.item() else cl))
    return sum(terms) / len(terms)
