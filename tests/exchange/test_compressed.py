"""The compressed exchange: the hook's non-finite names skip the step, the live codec knob, the
hook state saved per rank and applied when the hook is registered."""
from __future__ import annotations

import torch

from rapidfire_ray.exchange import CompressionPolicy, HookState
from rapidfire_ray.exchange.compressed import CompressedExchange

COMPRESSION = {"grad": "1bit", "keep_fp16": [], "min_numel": 16, "chunk_size": 2048, "auto_interval": 100}


class FakeDdp:
    def __init__(self, module):
        self.module, self.hooks = module, []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


def test_the_hooks_nonfinite_names_skip_the_step():
    exchange = CompressedExchange(COMPRESSION, rank=0)
    exchange.register(FakeDdp(torch.nn.Linear(3, 2)))
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    exchange.guard(opt, None)
    exchange.hook_state.nonfinite.extend(["weight", "bias", "weight"])
    w.grad = torch.ones(2)
    opt.step()
    assert exchange.skipped_steps == 1 and torch.equal(w.detach(), torch.ones(2))
    assert exchange.hook_state.nonfinite == []
    opt.step()
    assert exchange.skipped_steps == 1 and torch.equal(w.detach(), torch.zeros(2))


def test_the_codec_is_live_except_under_auto():
    exchange = CompressedExchange(COMPRESSION, rank=0)
    assert exchange.live_codec() == "1bit"
    exchange.set_codec("2bit")  # before the hook exists: the codec it is built with
    exchange.register(FakeDdp(torch.nn.Linear(3, 2)))
    assert exchange.hook_state.policy.grad == "2bit"
    exchange.set_codec("fp16")
    assert exchange.hook_state.policy.grad == "fp16" and exchange.live_codec() == "fp16"
    assert CompressedExchange({**COMPRESSION, "grad": "auto"}, rank=0).live_codec() is None


def test_the_hook_state_is_saved_per_rank_and_restored_at_registration(tmp_path):
    exchange = CompressedExchange(COMPRESSION, rank=1)
    exchange.save(str(tmp_path))
    assert not (tmp_path / "comm_state_rank1.pt").exists()  # no hook yet: nothing to save
    exchange.register(FakeDdp(torch.nn.Linear(3, 2)))
    exchange.hook_state.policy.choices["weight"] = "2bit"
    exchange.save(str(tmp_path))
    state = torch.load(tmp_path / "comm_state_rank1.pt", weights_only=True)
    assert list(state) == ["hook"]
    HookState([], CompressionPolicy("1bit")).load_state_dict(state["hook"])  # the hook's own format
    resumed = CompressedExchange(COMPRESSION, rank=1)
    resumed.load(str(tmp_path))
    resumed.register(FakeDdp(torch.nn.Linear(3, 2)))
    assert resumed.hook_state.policy.choices == {"weight": "2bit"}
