"""Gradient exchange: one `GradientExchange` per `communication.mode` (ddp, compressed,
onebit_adam, parameter_server; `build_exchange` chooses), and the primitives they use: the
two-phase compressed allreduce of 1-bit Adam, a DDP communication hook built on it, the
per-parameter codec policy, and byte/latency accounting.

    exchange = build_exchange(cfg["communication"], cfg["optimizer"], rank=rank, total_steps=n)

    state = HookState(ddp_model.module.named_parameters(), CompressionPolicy("1bit"))
    ddp_model.register_comm_hook(state, compressed_allreduce_hook)
"""
from __future__ import annotations

from .allreduce import (
           ALIGN,
           AllreduceState,
           compressed_allreduce,
           layout,
           simulate_compressed_allreduce,
)
from .base import GradientExchange, NonFiniteStep
from .factory import build_exchange
from .hook import HookState, compressed_allreduce_hook
from .policy import DEFAULT_KEEP_FP16, CompressionPolicy, concentration
from .stats import CommStats, fp32_allreduce_bytes

__all__ = [
           "ALIGN",
           "DEFAULT_KEEP_FP16",
           "AllreduceState",
           "CommStats",
           "CompressionPolicy",
           "GradientExchange",
           "HookState",
           "NonFiniteStep",
           "build_exchange",
           "compressed_allreduce",
           "compressed_allreduce_hook",
           "concentration",
           "fp32_allreduce_bytes",
           "layout",
           "simulate_compressed_allreduce",
]
