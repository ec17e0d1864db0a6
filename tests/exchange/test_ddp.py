"""The plain DDP exchange skips a step whose averaged gradients are not finite (in one process:
the averaged gradient is the local one)."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.exchange import NonFiniteStep
from rapidfire_ray.exchange.ddp import DdpExchange


def guarded(on_nonfinite: str = "skip"):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = DdpExchange(rank=0, on_nonfinite=on_nonfinite)
    exchange.guard(opt, model)
    return model, opt, exchange


def backward(model, nan: bool) -> None:
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    if nan:
        model.bias.grad[0] = float("nan")


def test_a_nan_gradient_skips_the_step_and_training_goes_on():
    model, opt, exchange = guarded()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, nan=True)
    opt.step()
    assert exchange.skipped_steps == 1 and model.bias.grad is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    backward(model, nan=False)
    opt.step()
    assert exchange.skipped_steps == 1 and not torch.equal(model.weight.detach(), before[0])


def test_on_nonfinite_fail_names_the_parameter():
    model, opt, _ = guarded("fail")
    backward(model, nan=True)
    with pytest.raises(NonFiniteStep) as e:
        opt.step()
    assert e.value.names == ["bias"]
