"""What every exchange shares: counting or failing a skipped step, the step guard, per-rank state
files, the per-step stats."""
from __future__ import annotations

import os

import pytest
import torch

from rapidfire_ray.exchange.base import GradientExchange, NonFiniteStep


class Recorded(GradientExchange):
    """An exchange whose optimizer skipped the steps listed in `bad` (1-based calls)."""

    def __init__(self, bad=(), **kw):
        super().__init__(**kw)
        self.bad, self.calls, self.saved = set(bad), 0, {}

    def register(self, ddp_model) -> None:
        pass

    def _nonfinite_before_step(self, optimizer, model):
        self.calls += 1
        return ["w"] if self.calls in self.bad else None

    def state_dict(self) -> dict:
        return dict(self.saved)

    def load_state_dict(self, state: dict) -> None:
        self.saved = state


def guarded(exchange):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1.0)
    exchange.guard(opt, None)
    return w, opt


def test_a_skipped_step_is_counted_and_the_optimizer_does_not_step():
    exchange = Recorded(bad={2}, rank=0)
    w, opt = guarded(exchange)
    for _ in range(3):
        w.grad = torch.ones(3)
        opt.step()
    assert exchange.skipped_steps == 1 and torch.equal(w.detach(), torch.full((3,), -1.0))  # 2 of 3 steps applied
    assert exchange.take_stats()["skipped_steps"] == 1


def test_on_nonfinite_fail_raises_with_the_names_and_counts_nothing():
    exchange = Recorded(bad={1}, rank=0, on_nonfinite="fail")
    w, opt = guarded(exchange)
    w.grad = torch.ones(3)
    with pytest.raises(NonFiniteStep) as e:
        opt.step()
    assert e.value.names == ["w"] and "communication.on_nonfinite: fail" in str(e.value)
    assert exchange.skipped_steps == 0 and torch.equal(w.detach(), torch.ones(3))


def test_state_goes_to_comm_state_rank_file_only_when_there_is_some(tmp_path):
    exchange = Recorded(rank=3)
    assert exchange.save(str(tmp_path)) == str(tmp_path) and not os.listdir(tmp_path)
    exchange.saved = {"hook": {"x": torch.ones(2)}}
    exchange.save(str(tmp_path))
    assert os.listdir(tmp_path) == ["comm_state_rank3.pt"]
    again = Recorded(rank=3)
    again.load(str(tmp_path))
    assert torch.equal(again.saved["hook"]["x"], torch.ones(2))
    Recorded(rank=1).load(str(tmp_path))  # no file of rank 1: nothing to restore


def test_take_stats_has_the_step_counters_and_the_untimed_phase():
    out = Recorded(rank=0).take_stats()
    assert out["untimed_comm_phase"] is None and out["skipped_steps"] == 0
    assert {"bytes_sent", "comm_seconds", "compression_ratio"} <= out.keys()


def test_the_run_course_hooks_do_nothing_by_default():
    exchange = Recorded(rank=0)
    exchange.begin()
    exchange.before_save()
    with exchange.around_report(last=True):
        pass
    assert exchange.finish() is None and exchange.live_codec() is None
    assert exchange.build_optimizer([], None) is None and exchange.clip_grad_norm(None, 1.0) is None
