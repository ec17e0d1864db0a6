"""DeepSpeed ZeRO-3 for memory level3 and `scaling.hybrid_parallel`, through the transformers
Trainer's `deepspeed=` argument (TRL trainers accept it as is).

`deepspeed_config` (stage 3, 16-bit weights saved with each checkpoint, optional CPU offload,
hpZ for `hybrid_parallel`), `prepare_process()` (two DeepSpeed 0.19.8 fixes for CPU workers)
and `held_bytes` (what one worker really holds). What the fixes are and why: docs/memory.md.
"""
from __future__ import annotations

import importlib
import itertools

import torch

from ..errors import RapidfireError
from .levels import MemoryOptions


def deepspeed_config(options: MemoryOptions, *, local_world_size: int, use_gpu: bool) -> dict:
    # "auto" sizes: transformers derives them from the model's hidden size (parameters under 10 x hidden
    # elements, e.g. norms, stay whole on every worker: gathering them would cost more than they weigh).
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto"}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    if options.hybrid:
        zero["zero_hpz_partition_size"] = max(1, local_world_size)
    return {
        "zero_optimization": zero,
        # "auto": transformers fills these from the TrainingArguments, so the two never disagree.
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    }


def prepare_process(use_gpu: bool) -> None:
    """The CPU fixes described in docs/memory.md (idempotent), then DeepSpeed's view of the
    process group Ray Train started: it must exist before the model is built, so that transformers
    builds it already partitioned (zero.Init) instead of whole on every worker."""
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    if not getattr(Stage3, "_rapidfire_fp32_sharing", False):
        create = Stage3._create_fp32_partitions

        def _create_fp32_partitions(self):
            device = self.device
            if isinstance(device, str) and not self.offload_optimizer:
                self.device = torch.device(device)
            try:
                return create(self)
            finally:
                self.device = device

        Stage3._create_fp32_partitions = _create_fp32_partitions
        Stage3._rapidfire_fp32_sharing = True
    # `import deepspeed.comm.torch as m` would bind the torch package itself: import the module by name.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")


def hybrid_group_size() -> int:
    """The hpZ group: the workers of one Ray node (by node id, not IP: several nodes may share an
    address). DeepSpeed's groups are equal blocks of consecutive ranks, so every node must hold as
    many workers, numbered consecutively (Ray Train numbers workers node by node)."""
    import ray
    import torch.distributed as dist

    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    runs = [len(list(group)) for _, group in itertools.groupby(nodes)]
    if len(set(runs)) != 1 or len(runs) != len(set(nodes)):
        counts = [nodes.count(n) for n in dict.fromkeys(nodes)]
        raise RapidfireError(f"scaling.hybrid_parallel: workers per node {counts} (in rank order: {runs}) are not "
                             "equal consecutive blocks; use scaling.placement SPREAD with scaling.num_workers a "
                             "multiple of the node count, or turn hybrid_parallel off")
    return runs[0]


def _unique_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def held_bytes(model: torch.nn.Module, optimizer) -> dict:
    """Bytes this worker holds: parameters (its partitions under ZeRO-3), fp32 master copies kept
    as separate tensors, optimizer state."""
    while hasattr(model, "module"):
        model = model.module
    params = list(model.parameters())
    seen: set[int] = set()
    if params and hasattr(params[0], "ds_tensor"):
        parameters = _unique_bytes([p.ds_tensor for p in params], seen)
        parameters += _unique_bytes([p.data for p in params], seen)  # persistent (small) parameters, if any
        parameters += _unique_bytes([getattr(p, "ds_secondary_tensor", None) for p in params], seen)  # hpZ
    else:
        parameters = _unique_bytes([p.data for p in params], seen)
    master, inner = 0, optimizer
    for _ in range(4):  # HF AcceleratedOptimizer -> DeepSpeed ZeRO optimizer -> torch optimizer
        flats = getattr(inner, "fp32_partitioned_groups_flat", None)
        if flats is not None:
            master = _unique_bytes(flats, seen)
        if isinstance(inner, torch.optim.Optimizer) and inner.state:
            break
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            break
    state = _unique_bytes(_state_tensors(inner), seen) if inner is not None else 0
    return {"parameters": parameters, "fp32_master": master, "optimizer_state": state + master,
            "total": parameters + state + master,
            "hpz_group_size": getattr(params[0], "ds_secondary_tensor_group_size", None) if params else None}
