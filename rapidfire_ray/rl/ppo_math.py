"""PPO's math, as pure tensor functions (checked against hand-computed examples in tests/rl).

Shapes: `[batch, T]` over the completion tokens, right-padded; `mask` is 1 on a completion's
tokens (its end-of-sequence token included) and 0 after it. The conventions are those of the
PPO trainer TRL used to ship (and of "Fine-Tuning Language Models from Human Preferences"):
a per-token reward of `-kl_beta * (log pi - log pi_ref)` plus the sequence's score on its last
token; generalised advantage estimation; advantages whitened over the batch; clipped surrogate
policy loss; clipped value loss.
"""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked entries (the mean added back with shift_mean=False);
    zero outside the mask."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def token_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                  mask: torch.Tensor, kl_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token rewards, per-token KL estimate): `-kl_beta * kl` on every token, plus each
    sequence's score on its last token."""
    kl = (logprobs - ref_logprobs) * mask if ref_logprobs is not None else torch.zeros_like(logprobs)
    rewards = -kl_beta * kl
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] += scores.to(rewards.dtype)
    return rewards * mask, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalised advantage estimation:
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, R_t = A_t + V_t,
    with V and A zero after a completion's end."""
    values = values * mask
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_range: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)),
    r = pi/pi_old; with the clip fraction and the approximate KL 0.5 E[(log r)^2]."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    return loss, {"clip_fraction": masked_mean((clipped > unclipped).float(), mask).detach(),
                  "approx_kl": (0.5 * masked_mean(log_ratio ** 2, mask)).detach()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 mean over tokens of max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_err, clipped_err), mask)
    return loss, {"value_clip_fraction": masked_mean((clipped_err > unclipped_err).float(), mask).detach()}


def completion_mask(completion_ids: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """1 up to and including each row's first end-of-sequence token (every token where there is none)."""
    if eos_id is None:
        return torch.ones_like(completion_ids, dtype=torch.float32)
    is_eos = completion_ids == eos_id
    # position of the first eos (T where none): tokens at or before it are the completion
    T = completion_ids.shape[1]
    first = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1), torch.full_like(is_eos[:, 0], T,
                                                                                          dtype=torch.long))
    return (torch.arange(T, device=completion_ids.device)[None, :] <= first[:, None]).float()
