"""Importance sampling matters: on data from a stale, very different behaviour policy, the
token-level IS-corrected loss follows the exact on-policy policy gradient; the uncorrected loss
follows the gradient theory predicts for the behaviour distribution instead.

Setting: a 5-armed bandit, policy = softmax over a logits ``nn.Parameter``, one-token
"sequences". For ``J(theta) = sum_a pi(a) r(a)`` the exact gradient is
``dJ/dtheta = pi * (r - E_pi[r])``. A sample from ``mu`` without correction estimates
``E_mu[(r - b) grad log pi] = sum_a mu(a) (r(a) - b) (e_a - pi)`` instead.
"""

import torch
from torch import nn

from psrl.algo import grpo_advantages, policy_loss
from psrl.config import AlgorithmConfig, RolloutCorrectionConfig

REWARD = torch.tensor([1.0, 0.4, 0.0, 0.1, 0.6], dtype=torch.float64)
BEHAVIOUR_LOGITS = torch.tensor([-3.0, 2.5, 0.0, 1.0, -2.0], dtype=torch.float64)  # rarely plays the best arm
N_SAMPLES = 20000


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def _expected_reward(logits: torch.Tensor) -> float:
    return float(torch.softmax(logits, 0) @ REWARD)


def _sampled_descent_direction(theta: nn.Parameter, actions, behav_logp, is_mode, threshold=1e3):
    """(-grad of policy_loss on the sampled batch, metrics); old_logp=None: theta is the pre-update
    policy. The default threshold is above max pi/mu (about 104 here): untruncated, unbiased IS."""
    cfg = AlgorithmConfig(
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        rollout_correction=RolloutCorrectionConfig(is_=is_mode, is_threshold=threshold),
    )
    logp = torch.log_softmax(theta, 0)[actions][:, None]
    adv = grpo_advantages(REWARD[actions][None, :], norm_by_std=False)[0]  # batch-mean baseline
    theta.grad = None
    loss, metrics = policy_loss(logp, None, behav_logp[:, None], adv, torch.ones_like(logp), cfg)
    loss.backward()
    return -theta.grad.detach().clone(), metrics


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64) * 0.3)
    mu = torch.softmax(BEHAVIOUR_LOGITS, 0)
    actions = torch.multinomial(mu, N_SAMPLES, replacement=True, generator=g)
    return theta, mu, actions, torch.log(mu)[actions]


def test_is_correction_recovers_on_policy_gradient():
    """cos(corrected, exact) is high and beats cos(uncorrected, exact); the uncorrected step
    matches the biased behaviour-policy expectation; the corrected step gains more reward."""
    theta, mu, actions, behav_logp = _setup()
    pi = torch.softmax(theta.detach(), 0)

    exact = pi * (REWARD - pi @ REWARD)
    corrected, m = _sampled_descent_direction(theta, actions, behav_logp, "token")
    uncorrected, _ = _sampled_descent_direction(theta, actions, behav_logp, None)

    b = float(REWARD[actions].mean())
    eye = torch.eye(5, dtype=torch.float64)
    behaviour_expectation = sum(mu[a] * (REWARD[a] - b) * (eye[a] - pi) for a in range(5))

    cos_c, cos_u = _cos(corrected, exact), _cos(uncorrected, exact)
    assert cos_c > 0.97, cos_c
    assert cos_c > cos_u + 0.2, (cos_c, cos_u)
    assert _cos(uncorrected, behaviour_expectation) > 0.99
    assert m["correction/is_weight_max"] > 10  # the data really is far off-policy
    lr = 0.5
    base = _expected_reward(theta.detach())
    gain_c = _expected_reward(theta.detach() + lr * corrected) - base
    gain_u = _expected_reward(theta.detach() + lr * uncorrected) - base
    assert gain_c > gain_u and gain_c > 0


def test_truncation_trades_bias_for_variance():
    """Truncated IS (C=2, the default) is biased towards the behaviour policy: its direction lies
    between the uncorrected and the untruncated one, and is still clearly better than none."""
    theta, _, actions, behav_logp = _setup()
    pi = torch.softmax(theta.detach(), 0)
    exact = pi * (REWARD - pi @ REWARD)
    cos = {
        c: _cos(_sampled_descent_direction(theta, actions, behav_logp, "token", c)[0], exact) for c in (1e3, 10.0, 2.0)
    }
    cos_u = _cos(_sampled_descent_direction(theta, actions, behav_logp, None)[0], exact)
    assert cos[1e3] > cos[10.0] > cos[2.0] > cos_u + 0.2, (cos, cos_u)


def test_on_policy_data_needs_no_correction():
    """Control: when mu == pi the weights are 1 and both losses give the same gradient."""
    g = torch.Generator().manual_seed(1)
    theta = nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64) * 0.3)
    pi = torch.softmax(theta.detach(), 0)
    actions = torch.multinomial(pi, 2000, replacement=True, generator=g)
    behav_logp = torch.log(pi)[actions]
    corrected, m = _sampled_descent_direction(theta, actions, behav_logp, "token")
    uncorrected, _ = _sampled_descent_direction(theta, actions, behav_logp, None)
    assert torch.allclose(corrected, uncorrected, atol=1e-12)
    assert abs(m["correction/is_weight_mean"] - 1.0) < 1e-12
