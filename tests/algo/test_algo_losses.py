"""Aggregation modes and the PPO / GSPO policy losses: values against plain-float loops, gradients
against per-token torch loops, GSPO against its sequence-level statement, and degenerate input."""

import math

import pytest
import torch

from psrl.algo import aggregate, policy_loss
from psrl.config import AlgorithmConfig, RolloutCorrectionConfig
from tests.algo.algo_reference import (
    gspo_sequence_level_loss,
    ref_aggregate,
    ref_correction,
    ref_gspo_token_losses,
    ref_ppo_token_losses,
    torch_loop_loss,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
CLIPS = {"ppo": (0.2, 0.28), "gspo": (0.03, 0.04)}  # GSPO runs with much tighter clips


def _mask(g, B, T):
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[1] = 0.0  # one sequence that is all padding
    return mask


def _batch(seed, B=6, T=7, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    behav = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    adv_seq = torch.randn(B, generator=g, dtype=torch.float64)
    adv_tok = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, behav, adv_seq, adv_tok, _mask(g, B, T)


def _cfg(kind, mode, is_mode=None, rs_mode=None):
    low, high = CLIPS[kind]
    rc = RolloutCorrectionConfig(is_=is_mode, is_threshold=1.2, rs=rs_mode, rs_threshold=1.5)
    return AlgorithmConfig(
        policy_loss=kind, loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high, rollout_correction=rc
    )


# ------------------------------------------------------------------ aggregate


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_aggregate_matches_reference(mode, seed):
    """aggregate == loop reference, values and gradients (garbage at padding is ignored)."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = _mask(g, 5, 6)
    loss[mask == 0] = float("nan")
    x = loss.clone().requires_grad_()
    out = aggregate(x, mask, mode)
    assert out.item() == pytest.approx(ref_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-12)
    out.backward()
    n_tok, n_seq = mask.sum(), (mask.sum(1) > 0).sum()
    per_row = {"token-mean": 1 / n_tok, "seq-mean-token-sum": 1 / n_seq}
    want = mask * (per_row[mode] if mode in per_row else 1 / (n_seq * mask.sum(1, keepdim=True).clamp(min=1)))
    assert torch.allclose(x.grad, want)


def test_aggregate_modes_differ_as_expected():
    """token-mean weighs long sequences more; seq-mean-token-mean weighs sequences equally."""
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(4 / 5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(0.5)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(2.0)
    assert aggregate(loss, mask.bool(), "token-mean").item() == pytest.approx(4 / 5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_all_masked_is_zero_with_graph(mode):
    """No valid token at all: loss 0, backward works, gradient 0 (no 0/0)."""
    x = torch.full((2, 3), float("inf"), requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros(2, 3))


def test_aggregate_unknown_mode_names_key():
    """An unknown mode is an error naming algorithm.loss_agg_mode."""
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


# ------------------------------------------------------------------ policy loss vs reference


def _reference(kind, mode, logp, old, behav, adv, mask, cfg):
    """(value from plain floats, gradient from the per-token torch loop, effective mask)."""
    rc = cfg.rollout_correction
    if behav is None:
        w, keep = mask.tolist(), mask.tolist()
    else:
        w, keep = ref_correction(
            old.tolist(),
            behav.tolist(),
            mask.tolist(),
            rc.is_,
            rc.is_threshold,
            rc.rs,
            rc.rs_threshold,
            rc.rs_threshold_lower,
        )
    eff = [[m * k for m, k in zip(mr, kr)] for mr, kr in zip(mask.tolist(), keep)]
    low, high = cfg.clip_ratio_low, cfg.clip_ratio_high
    args = (logp.tolist(), old.tolist(), adv.tolist(), w)
    tok = ref_ppo_token_losses(*args, low, high) if kind == "ppo" else ref_gspo_token_losses(*args, eff, low, high)
    value = ref_aggregate(tok, eff, mode)
    leaf = logp.detach().clone().requires_grad_()
    torch_loop_loss(leaf, old.tolist(), adv.tolist(), w, eff, low, high, kind, mode).backward()
    return value, leaf.grad, eff


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "is_mode, rs_mode, per_token",
    [
        (None, None, False),
        ("token", None, True),
        ("sequence", "token", False),
        ("token", "geometric", True),
        (None, "sequence", False),
    ],
)
def test_policy_loss_matches_reference(kind, mode, is_mode, rs_mode, per_token):
    """policy_loss value and autograd gradient equal the slow references, for both losses, every
    aggregation mode, per-sequence and per-token advantages, with and without corrections.
    The batches clip some tokens, so both branches of the min are exercised."""
    clipped = 0.0
    for seed in (0, 1):
        logp, old, behav, adv_seq, adv_tok, mask = _batch(seed, spread=0.3 if kind == "ppo" else 0.1)
        cfg = _cfg(kind, mode, is_mode, rs_mode)
        adv = adv_tok if per_token else adv_seq
        loss, metrics = policy_loss(logp, old, behav, adv, mask, cfg)
        full_adv = adv if per_token else adv[:, None].expand_as(logp)
        value, grad, _ = _reference(kind, mode, logp, old, behav, full_adv, mask, cfg)
        assert loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)
        loss.backward()
        assert torch.allclose(logp.grad, grad, rtol=1e-9, atol=1e-12)
        assert metrics["loss/policy"] == pytest.approx(value, rel=1e-10, abs=1e-12)
        clipped += metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"]
    assert clipped > 0


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_clip_metrics_match_counts(kind):
    """clip_frac_low/high count tokens whose gradient the clip removes; ratio_mean and k3 approx_kl
    are means over valid tokens; the batch does clip on both sides (non-vacuous)."""
    logp, old, _, _, adv, mask = _batch(5, B=16, T=9, spread=0.3 if kind == "ppo" else 0.15)
    cfg = _cfg(kind, "token-mean")
    _, m = policy_loss(logp, old, None, adv, mask, cfg)
    low, high = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    lo_n = hi_n = n = 0
    ratios, kls = [], []
    for lp_row, o_row, a_row, m_row in zip(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist()):
        valid = [i for i, x in enumerate(m_row) if x]
        seq = math.exp(sum(lp_row[i] - o_row[i] for i in valid) / len(valid)) if valid else 1.0
        for i in valid:
            r = math.exp(lp_row[i] - o_row[i]) if kind == "ppo" else seq
            lo_n += r < low and a_row[i] < 0
            hi_n += r > high and a_row[i] > 0
            n += 1
            ratios.append(r)
            d = lp_row[i] - o_row[i]
            kls.append(math.exp(d) - 1 - d)
    assert lo_n > 0 and hi_n > 0
    assert m["actor/clip_frac_low"] == pytest.approx(lo_n / n)
    assert m["actor/clip_frac_high"] == pytest.approx(hi_n / n)
    assert m["actor/ratio_mean"] == pytest.approx(sum(ratios) / n)
    assert m["actor/approx_kl"] == pytest.approx(sum(kls) / n) and m["actor/approx_kl"] > 0


def test_gspo_token_trick_equals_sequence_level_gspo():
    """With per-sequence advantages and seq-mean-token-mean, the stop-gradient token form has the
    value and the gradient of GSPO written at the sequence level (the paper's identity)."""
    logp, old, _, adv, _, mask = _batch(7, B=10, spread=0.1)
    cfg = _cfg("gspo", "seq-mean-token-mean")
    loss, _ = policy_loss(logp, old, None, adv, mask, cfg)
    loss.backward()
    leaf = logp.detach().clone().requires_grad_()
    ref = gspo_sequence_level_loss(leaf, old.tolist(), adv.tolist(), mask.tolist(), *CLIPS["gspo"])
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(logp.grad, leaf.grad, rtol=1e-10, atol=1e-14)
    assert (leaf.grad.abs() > 0).any()


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_old_logp_none_is_on_policy(kind):
    """old_logp=None uses logp.detach(): ratio 1, nothing clipped, gradient = -A grad(logp) aggregated."""
    logp, _, _, adv, _, mask = _batch(5)
    loss, m = policy_loss(logp, None, None, adv, mask, _cfg(kind, "token-mean"))
    loss.backward()
    assert m["actor/ratio_mean"] == 1.0 and m["actor/clip_frac_low"] == 0.0 and m["actor/approx_kl"] == 0.0
    assert torch.allclose(logp.grad, -adv[:, None] * mask / mask.sum())


def test_behaviour_logp_reports_metrics_without_correction():
    """With behav_logp but no IS/RS the loss is unchanged and the correction metrics still appear."""
    logp, old, behav, adv, _, mask = _batch(6)
    cfg = _cfg("ppo", "token-mean")
    with_b, m = policy_loss(logp, old, behav, adv, mask, cfg)
    without, m0 = policy_loss(logp, old, None, adv, mask, cfg)
    assert with_b.item() == without.item()
    assert "correction/rho_mean" in m and "correction/rho_mean" not in m0


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("is_mode, rs_mode", [(None, None), ("sequence", "geometric"), ("token", "token")])
def test_all_masked_sequences_no_nan(kind, mode, is_mode, rs_mode):
    """All-padding sequences with -inf/nan in their log-probs and advantages, and a batch with no
    valid token, give a finite loss, finite gradients (0 at padding) and finite metrics."""
    logp, old, behav, _, adv, mask = _batch(8)
    adv = torch.where(mask > 0, adv, torch.full_like(adv, float("nan")))
    raw = logp.detach().clone()
    raw[1] = -float("inf")
    old = old.clone()
    old[1] = float("nan")
    behav = behav.clone()
    behav[1] = -float("inf")
    x = raw.requires_grad_()
    for m_ in (mask, torch.zeros_like(mask)):
        x.grad = None
        loss, metrics = policy_loss(x, old, behav, adv, m_, _cfg(kind, mode, is_mode, rs_mode))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert (x.grad[m_ == 0] == 0).all()
        assert all(math.isfinite(v) for v in metrics.values())


def test_bad_shapes_and_names():
    """Advantages of the wrong shape and an unknown loss name are errors that say so."""
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, None, None, torch.zeros(3), torch.ones(2, 3), AlgorithmConfig())
    with pytest.raises(ValueError, match="policy_loss"):
        policy_loss(logp, None, None, torch.zeros(2), torch.ones(2, 3), AlgorithmConfig(policy_loss="reinforce"))


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_float32_and_bool_mask(kind):
    """float32 log-probs with a bool mask give the float64 result to float32 precision and a
    float32 gradient (the dtype the model produces)."""
    logp, old, behav, adv, _, mask = _batch(9)
    cfg = _cfg(kind, "seq-mean-token-mean", "token", "geometric")
    ref, _ = policy_loss(logp, old, behav, adv, mask, cfg)
    ref.backward()
    x = logp.detach().float().requires_grad_()
    out, _ = policy_loss(x, old.float(), behav.float(), adv.float(), mask.bool(), cfg)
    out.backward()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert out.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(x.grad.double(), logp.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
def test_token_loss_weighted_by_global_denominators_is_the_policy_loss(kind, mode):
    """A sharded trainer sums ``weight * token_loss`` over rows split across ranks: with the planner's weights of the
    effective mask (rejection sampling on), that sum and its gradient equal ``policy_loss`` of the whole batch."""
    from psrl.algo.losses import token_loss
    from psrl.train.planner import loss_weights

    logp, old, behav, adv, _, mask = _batch(3)
    cfg = _cfg(kind, mode, "token", "token")
    want, _ = policy_loss(logp, old, behav, adv, mask, cfg)
    (g_want,) = torch.autograd.grad(want, logp)
    got = torch.zeros((), dtype=torch.float64)
    _, eff_all = token_loss(logp, old, behav, adv, mask, cfg)
    w = loss_weights({i: eff_all[i].tolist() for i in range(len(mask))}, mode)
    for rows in ([0, 3], [1, 2, 4, 5]):  # two "ranks"
        per_token, _ = token_loss(logp[rows], old[rows], behav[rows], adv[rows], mask[rows], cfg)
        got = got + (per_token * torch.tensor([w[i] for i in rows], dtype=torch.float64)).sum()
    (g_got,) = torch.autograd.grad(got, logp)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-12)
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-12)
