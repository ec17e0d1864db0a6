"""PPO's advantage, whitening and clipping math against small examples computed by hand."""
from __future__ import annotations

import math

import torch

from rapidfire_ray.rl import ppo_math


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_gae_two_sequences_by_hand():
    # seq 0: rewards [0, 0, 1], values [0.5, 0.2, 0.4], gamma 1, lambda 0.5
    #   delta2 = 1 - 0.4 = 0.6            A2 = 0.6
    #   delta1 = 0 + 0.4 - 0.2 = 0.2      A1 = 0.2 + 0.5 * 0.6 = 0.5
    #   delta0 = 0 + 0.2 - 0.5 = -0.3     A0 = -0.3 + 0.5 * 0.5 = -0.05
    # seq 1 ends after 2 tokens (the third is padding with junk reward/value that must not leak):
    #   delta1 = 2.0 + 0 - 0.5 = 1.5      A1 = 1.5
    #   delta0 = 0.1 + 0.5 - 1.0 = -0.4   A0 = -0.4 + 0.5 * 1.5 = 0.35
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.1, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ppo_math.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[-0.05, 0.5, 0.6], [0.35, 1.5, 0.0]])
    assert close(ret, [[0.45, 0.7, 1.0], [1.35, 2.0, 0.0]])


def test_gae_discount():
    # one token: A = r - V; two tokens, gamma 0.5, lambda 1: A0 = r0 + 0.5 * r1 - V0 (Monte Carlo)
    adv, _ = ppo_math.gae(torch.tensor([[1.0, 4.0]]), torch.tensor([[0.5, 3.0]]), torch.ones(1, 2), 0.5, 1.0)
    assert close(adv, [[1.0 + 0.5 * 4.0 - 0.5, 4.0 - 3.0]])


def test_whiten_uses_only_masked_entries():
    # mean 2, unbiased variance ((1 + 0 + 1) / 3) * 3 / 2 = 1: whitened [-1, 0, 1]; the masked 10 is ignored
    x = torch.tensor([[1.0, 2.0], [3.0, 10.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert close(ppo_math.masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]], tol=1e-4)
    assert close(ppo_math.masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0], [3.0, 0.0]], tol=1e-4)


def test_policy_loss_clipping_by_hand():
    # ratios [1.5, 0.5, 1.0], advantages [1, 1, -1], epsilon 0.2:
    #   t0: -1.5 vs clipped -1.2 -> -1.2 (clipped)   t1: -0.5 vs -0.8 -> -0.5   t2: 1 vs 1 -> 1
    #   loss = (-1.2 - 0.5 + 1) / 3; clip fraction 1/3; approx KL = 0.5 mean(log r ^ 2)
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    new = old + torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, stats = ppo_math.policy_loss(new, old, adv, torch.ones(1, 3), clip_range=0.2)
    assert math.isclose(float(loss), -0.7 / 3, abs_tol=1e-6)
    assert math.isclose(float(stats["clip_fraction"]), 1 / 3, abs_tol=1e-6)
    expected_kl = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3
    assert math.isclose(float(stats["approx_kl"]), expected_kl, abs_tol=1e-6)


def test_policy_loss_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    loss, _ = ppo_math.policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2), clip_range=0.2)
    loss.backward()
    # token 0 is clipped (ratio 1.5 > 1.2 with a positive advantage): no gradient; token 1: -A r / 2
    assert close(new.grad, [[0.0, -0.5]])


def test_value_loss_clipping_by_hand():
    # t0: V 1.0, old 0.5, R 0.8 -> clipped V 0.7: errors 0.04 vs 0.01 -> 0.04 (not clipped)
    # t1: V -1.5, old 0.1, R -1.0 -> clipped V -0.1: errors 0.25 vs 0.81 -> 0.81 (clipped)
    loss, stats = ppo_math.value_loss(torch.tensor([[1.0, -1.5]]), torch.tensor([[0.5, 0.1]]),
                                      torch.tensor([[0.8, -1.0]]), torch.ones(1, 2), clip_range=0.2)
    assert math.isclose(float(loss), 0.5 * (0.04 + 0.81) / 2, abs_tol=1e-6)
    assert math.isclose(float(stats["value_clip_fraction"]), 0.5, abs_tol=1e-6)


def test_token_rewards_kl_penalty_and_score_on_last_token():
    # kl = [0.5, -1.0, (masked)]; beta 0.1 -> [-0.05, 0.1]; the score 2.0 lands on the last real token
    rewards, kl = ppo_math.token_rewards(torch.tensor([2.0]), torch.tensor([[-1.0, -2.0, -0.5]]),
                                         torch.tensor([[-1.5, -1.0, -3.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 0.1)
    assert close(kl, [[0.5, -1.0, 0.0]])
    assert close(rewards, [[-0.05, 2.1, 0.0]])


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 7, 2, 9, 2], [5, 6, 7, 8, 9], [2, 3, 3, 3, 3]])
    assert close(ppo_math.completion_mask(ids, eos_id=2), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
