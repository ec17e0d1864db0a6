"""`communication.mode: allreduce` with AdamW: DDP's averaging allreduce in fp32, its bytes and
in-flight time counted. Averaged gradients are the same on every rank, so each rank checks them
itself and all skip a non-finite step alike."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .base import GradientExchange
from .stats import fp32_allreduce_bytes


def counted_allreduce_hook(exchange: DdpExchange, bucket):  # no annotations: DDP checks them at runtime
    """DDP's default averaging allreduce, with its in-flight time and bytes recorded."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    start = time.perf_counter()
    fp32 = fp32_allreduce_bytes(buffer.numel(), world)
    wire = fp32 * buffer.element_size() / 4  # a ring allreduce of this buffer, per rank
    exchange.stats.add_bytes(wire, wire, fp32)
    buffer.div_(world)
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    if exchange.timer is not None:
        exchange.timer.comm_call(start, time.perf_counter())

    def done(f):
        end = time.perf_counter()
        exchange.stats.add_call(end - start)
        if exchange.timer is not None:
            exchange.timer.comm_interval(start, end)
        return f.value()[0]

    return fut.then(done)


class DdpExchange(GradientExchange):
    def register(self, ddp_model) -> None:
        ddp_model.register_comm_hook(self, counted_allreduce_hook)

    def _nonfinite_before_step(self, optimizer, model) -> list[str] | None:
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        # One multi-tensor kernel and one host read per step, not two kernels per tensor: the max-abs
        # norm is finite exactly when every element is (it cannot overflow; NaN propagates).
        if not named or bool(torch.stack(torch._foreach_norm([g for _, g in named], float("inf"))).isfinite().all()):
            return None
        names = [n for n, g in named if not torch.isfinite(g).all()]
        optimizer.zero_grad(set_to_none=True)
        return names
