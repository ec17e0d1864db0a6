"""Compressed gradient communication: the two-phase compressed allreduce of 1-bit Adam, a DDP
communication hook built on it, the per-parameter codec policy, and byte/latency accounting.

    from rapidfire_ray.comm import CompressionPolicy, HookState, compressed_allreduce_hook

    state = HookState(ddp_model.module.named_parameters(), CompressionPolicy("1bit"))
    ddp_model.register_comm_hook(state, compressed_allreduce_hook)

    # an optimizer that does its own exchange (1-bit Adam's momentum):
    out = compressed_allreduce(momentum, get_codec("1bit"), slot_state, group, stats)
"""
from __future__ import annotations

from .allreduce import (
           ALIGN,
           AllreduceState,
           compressed_allreduce,
           layout,
           simulate_compressed_allreduce,
)
from .hook import HookState, compressed_allreduce_hook
from .policy import DEFAULT_KEEP_FP16, CompressionPolicy, concentration
from .stats import CommStats, fp32_allreduce_bytes

__all__ = [
           "ALIGN",
           "DEFAULT_KEEP_FP16",
           "AllreduceState",
           "CommStats",
           "CompressionPolicy",
           "HookState",
           "compressed_allreduce",
           "compressed_allreduce_hook",
           "concentration",
           "fp32_allreduce_bytes",
           "layout",
           "simulate_compressed_allreduce",
]
