"""`local_gradient_hook`: the DDP communication hook that goes with `RapidfireAdamW` (plain
averaging allreduce in the warm-up, no communication in the compressed stage)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..exchange.stats import fp32_allreduce_bytes
from .rapidfire_adamw import RapidfireAdamW


def _unwrap(optimizer) -> RapidfireAdamW:
    # accelerate's AcceleratedOptimizer (what Trainer.optimizer is after prepare) wraps ours.
    while not isinstance(optimizer, RapidfireAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, RapidfireAdamW):
        raise TypeError(f"local_gradient_hook needs a RapidfireAdamW as its state, got {type(optimizer).__name__}")
    return optimizer


def local_gradient_hook(optimizer, bucket):  # no annotations: DDP rejects string ones (postponed evaluation)
    """DDP communication hook for RapidfireAdamW:
    `ddp_model.register_comm_hook(optimizer, local_gradient_hook)`.

    It runs during the backward of step t + 1, t = optimizer steps applied so far. Warm-up
    (t + 1 <= freeze_step): the plain averaging allreduce, as DDP's default. Compressed stage
    (t + 1 > freeze_step, `optimizer.in_compressed_stage`): no communication at all; the bucket
    comes back as this rank's local gradient, because the optimizer exchanges momentum instead.
    Use the optimizer's process group for DDP too. `optimizer`: the RapidfireAdamW (or a
    wrapper with `.optimizer`, such as accelerate's); `bucket`: a dist.GradBucket; returns a
    torch.futures.Future[torch.Tensor]."""
    optimizer = _unwrap(optimizer)
    buffer = bucket.buffer()
    if optimizer.in_compressed_stage:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    group, world = optimizer.world()
    optimizer.note_local_grads(buffer)  # before averaging: the clip's norm ratio (clipping.py)
    stats = optimizer.stats
    start = time.perf_counter()
    if stats is not None:
        wire = 2.0 * (world - 1) * buffer.numel() * buffer.element_size() / world if world > 1 else 0.0
        stats.add_bytes(wire, wire, fp32_allreduce_bytes(buffer.numel(), world))
    buffer.div_(world)
    work = dist.all_reduce(buffer, group=group, async_op=True)

    def done(f):
        if stats is not None:
            stats.add_call(time.perf_counter() - start)
        return f.value()[0]

    return work.get_future().then(done)
