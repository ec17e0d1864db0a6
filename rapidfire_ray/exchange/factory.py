"""`build_exchange`: the worker's `GradientExchange`, chosen by `communication.mode` and
`optimizer.type` (config/load.py rejects the combinations that do not go together)."""
from __future__ import annotations

from .base import GradientExchange


def build_exchange(communication: dict, optimizer: dict, *, rank: int, total_steps: int, timer=None,
                   shards: list | None = None, num_workers: int = 1) -> GradientExchange:
    """`communication`, `optimizer`: the config sections; `total_steps`: the run's optimizer
    steps (rapidfire_adamw's default warm-up); `timer`: the step timer told the exchange's
    intervals; `shards`, `num_workers`: the parameter server's actors and worker count."""
    on_nonfinite = communication["on_nonfinite"]
    compression = optimizer["params"]["compression"]
    if communication["mode"] == "parameter_server":
        from .parameter_server import ParameterServerExchange

        return ParameterServerExchange(communication, optimizer, shards, num_workers=num_workers, rank=rank,
                                       total_steps=total_steps, timer=timer)
    if optimizer["type"] == "rapidfire_adamw":
        from .onebit_adam import OneBitAdamExchange

        return OneBitAdamExchange(compression, freeze_step=optimizer["params"]["freeze_step"],
                                  total_steps=total_steps, rank=rank, on_nonfinite=on_nonfinite, timer=timer)
    if communication["mode"] == "allreduce_compressed":
        from .compressed import CompressedExchange

        return CompressedExchange(compression, rank=rank, on_nonfinite=on_nonfinite, timer=timer,
                                  overlap=communication.get("overlap", True))
    from .ddp import DdpExchange

    return DdpExchange(rank=rank, on_nonfinite=on_nonfinite, timer=timer)

