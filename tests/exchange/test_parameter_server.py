"""The parameter-server exchange with a stand-in client (the real one against shard actors runs in
tests/ps and tests/test_parameter_server.py): skipped pushes counted, the checkpoint layout per
rank, the run-course hooks."""
from __future__ import annotations

import os

import torch

from rapidfire_ray.compression import NonFiniteGradient
from rapidfire_ray.exchange.parameter_server import ParameterServerExchange, ParameterServerOptimizer

COMMUNICATION = {"mode": "parameter_server", "on_nonfinite": "skip", "ps": {"max_staleness": 2, "lr_per_push": "mean"}}
OPTIMIZER = {"type": "adamw", "params": {"freeze_step": None, "compression": {"grad": "none", "chunk_size": 2048}}}


class Client:
    def __init__(self):
        self.calls = []

    def push_and_pull(self, grads, lr):
        self.calls.append(("push", lr))
        if not all(torch.isfinite(g).all() for g in grads.values()):
            raise NonFiniteGradient("w", "none")
        return {"push_s": 0.1, "wait_s": 0.0, "bytes_sent": 12, "bytes_received": 12, "staleness": 0, "kind": "grad"}

    pull_latencies = [0.2]

    def state_dict(self):
        return {"seq": torch.tensor(3)}

    def pull_states(self):
        return [{"shard": 0}, {"shard": 1}]

    def finish(self):
        self.calls.append(("finish",))

    def pull(self):
        self.calls.append(("pull",))

    def report(self):
        return {"pushes": 1}


def exchange_with_client(rank: int = 0):
    exchange = ParameterServerExchange(COMMUNICATION, OPTIMIZER, [], num_workers=2, rank=rank, total_steps=8)
    w = torch.nn.Parameter(torch.ones(3))
    exchange.client = Client()
    exchange.optimizer = ParameterServerOptimizer([{"params": [w], "param_names": ["w"]}], exchange.client, lr=0.5,
                                                  lr_divisor=exchange.lr_divisor)
    exchange.guard(exchange.optimizer, None)
    return exchange, w


def test_a_nonfinite_push_is_a_counted_skip_and_the_stats_say_so():
    exchange, w = exchange_with_client()
    w.grad = torch.ones(3)
    exchange.optimizer.step()
    stats = exchange.take_stats()
    assert exchange.client.calls == [("push", 0.25)]  # lr / workers
    assert stats["untimed_comm_phase"] == "optimizer" and stats["ps_bytes_pushed"] == 12 and stats["skipped_steps"] == 0
    w.grad = torch.full((3,), float("nan"))
    exchange.optimizer.step()
    stats = exchange.take_stats()
    assert exchange.skipped_steps == 1 and stats["skipped_steps"] == 1 and stats["ps_push_s"] is None


def test_rank_0_saves_shards_and_client_in_the_checkpoint_other_ranks_their_own_folder(tmp_path):
    zero, _ = exchange_with_client(rank=0)
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    zero.before_save()
    assert zero.save(str(ckpt)) == str(ckpt)
    assert sorted(os.listdir(ckpt)) == ["comm_state_rank0.pt", "ps_shard_0.pt", "ps_shard_1.pt"]
    assert torch.load(ckpt / "comm_state_rank0.pt", weights_only=True)["ps_client"]["seq"] == 3
    one, _ = exchange_with_client(rank=1)
    own = tmp_path / "checkpoint-8"
    own.mkdir()
    assert one.save(str(own)) == f"{own}-rank1" and not own.exists()
    assert os.listdir(f"{own}-rank1") == ["comm_state_rank1.pt"]


def test_the_report_leaves_the_admission_set_and_pulls_again_unless_last():
    exchange, _ = exchange_with_client()
    with exchange.around_report(last=False):
        pass
    with exchange.around_report(last=True):
        pass
    assert exchange.client.calls == [("finish",), ("pull",), ("finish",)]
    assert exchange.finish() == {"pushes": 1}
