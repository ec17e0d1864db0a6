"""The shard's side of `optimizer.type: rapidfire_adamw` (1-bit Adam on the parameter server),
as pure functions of the shard's AdamW and parameters: the frozen preconditioner a worker takes
when it enters the compressed stage, and the step that applies a worker's pushed update.
The protocol: docs/parameter_server.md."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..optim import frozen_denom


@torch.no_grad()
def apply_updates(optimizer: torch.optim.AdamW, params: Mapping[str, torch.nn.Parameter], lr: float) -> None:
    """p -= lr * (weight_decay * p + update): the step AdamW would take with that update as
    its m_hat / (sqrt(v_hat) + eps) (decay first, as AdamW). The update arrived in .grad.
    The AdamW state is left as it is (its variance is what the workers froze)."""
    wd = optimizer.param_groups[0]["weight_decay"]
    for p in params.values():
        if p.grad is None:
            continue
        if wd:
            p.mul_(1 - lr * wd)
        st = optimizer.state.get(p)
        if not st:  # no gradient in any warm-up push: v == 0 everywhere, held still
            continue
        # Elements whose variance is 0 are held still (1-bit codes cannot send a zero).
        p.add_(p.grad.masked_fill_(st["exp_avg_sq"] == 0, 0.0), alpha=-lr)


def preconditioner(optimizer: torch.optim.AdamW, params: Mapping[str, torch.nn.Parameter]) -> dict:
    """What a worker entering rapidfire_adamw's compressed stage needs from a shard's AdamW
    state: per parameter `exp_avg` (its momentum starts from it) and `denom` = sqrt(v_hat) +
    eps (the frozen preconditioner), with `step` (updates in that state) and betas. A
    parameter without state (no gradient yet) gets zeros: its denom is eps and its mask
    (v == 0) holds it still."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    exp_avg, denom, zero, steps = {}, {}, {}, []
    for name, p in params.items():
        st = optimizer.state.get(p)
        if not st:
            exp_avg[name] = torch.zeros_like(p, dtype=torch.float32)
            denom[name] = torch.full_like(p, eps, dtype=torch.float32)
            zero[name] = torch.ones_like(p, dtype=torch.bool)
            continue
        t = int(st["step"])
        steps.append(t)
        denom[name] = frozen_denom(st["exp_avg_sq"], t, beta2, eps)
        exp_avg[name] = st["exp_avg"].detach().clone()
        zero[name] = st["exp_avg_sq"] == 0
    return {"step": max(steps, default=0), "betas": (beta1, beta2), "eps": eps,
            "exp_avg": exp_avg, "denom": denom, "zero_variance": zero}
