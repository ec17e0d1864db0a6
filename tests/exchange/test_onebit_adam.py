"""The rapidfire_adamw exchange: builds the optimizer from the trainer's arguments, counts the
compressed steps the optimizer skipped (not the ones a resumed optimizer brings), clips through
it, saves its per-rank error feedback."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from rapidfire_ray.exchange.onebit_adam import OneBitAdamExchange
from rapidfire_ray.optim import RapidfireAdamW

ARGS = SimpleNamespace(learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
COMPRESSION = {"grad": "1bit", "chunk_size": 8}


def built(rank: int = 0):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    exchange = OneBitAdamExchange(COMPRESSION, freeze_step=2, total_steps=10, rank=rank)
    named = [{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}]
    opt = exchange.build_optimizer(named, ARGS)
    exchange.guard(opt, model)
    return model, opt, exchange


def step(model, opt, bad: bool = False) -> None:
    opt.zero_grad()
    model(torch.ones(4, 5)).pow(2).sum().backward()
    if bad:
        model.bias.grad[0] = float("inf")
    opt.step()


def test_a_skipped_compressed_step_is_counted_once():
    model, opt, exchange = built()
    assert isinstance(opt, RapidfireAdamW) and opt.freeze_step == 2
    for _ in range(3):
        step(model, opt)
    assert exchange.take_stats()["untimed_comm_phase"] == "optimizer"  # compressed stage: exchange in the step
    step(model, opt, bad=True)
    assert exchange.skipped_steps == 1 and opt.skipped_steps == 1 and opt.nonfinite == ["bias"]
    step(model, opt)
    assert exchange.skipped_steps == 1


def test_a_resumed_optimizers_own_skip_count_is_not_a_new_skip():
    model, opt, exchange = built()
    opt.skipped_steps = 3  # as loaded from optimizer.pt
    step(model, opt)
    assert exchange.skipped_steps == 0


def test_clipping_goes_through_the_optimizer():
    model, opt, exchange = built()
    model(torch.ones(4, 5)).pow(2).sum().backward()
    norm = exchange.clip_grad_norm(model, 1e-3)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norm > 1e-3 and torch.isclose(total, torch.tensor(1e-3), rtol=1e-3)


def test_error_feedback_is_saved_per_rank_and_restored_when_the_optimizer_is_built(tmp_path):
    model, opt, exchange = built()
    for _ in range(4):
        step(model, opt)
    exchange.save(str(tmp_path))
    state = torch.load(tmp_path / "comm_state_rank0.pt", weights_only=True)
    assert list(state) == ["optimizer"] and state["optimizer"]["states"]
    resumed = OneBitAdamExchange(COMPRESSION, freeze_step=2, total_steps=10, rank=0)
    resumed.load(str(tmp_path))
    named = [{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}]
    again = resumed.build_optimizer(named, ARGS)
    for key, s in again.allreduce_state_dict()["states"].items():
        assert torch.equal(s["worker_error"], state["optimizer"]["states"][key]["worker_error"])
