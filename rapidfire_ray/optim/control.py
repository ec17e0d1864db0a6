"""Small control all_reduces of `RapidfireAdamW` (the step's agreement flags, the clip's norms):
where their tensors must live for a process group's backend."""
from __future__ import annotations

import torch
import torch.distributed as dist


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small control tensor must live for this group's backend."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
