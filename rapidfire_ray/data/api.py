"""The data layer's Python surface, for users with their own training loops:

    batches = (rapidfire_ray.data.pipeline(ray_dataset)
               .prefetch(3).shard_by_node().dynamic_batch(memory_threshold=0.8, model=model))
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for batch in batches:          # dicts of torch tensors: input_ids, attention_mask, labels
            loss = model(**batch).loss ...

Iterate it inside a Ray Train worker (`train_loop_per_worker`): it shards the dataset across the
run's workers (by node, exactly once per epoch), prefetches with Ray Data, and cuts batches
(fixed, token budget or memory-aware) with every rank taking the same number of batches, the
same machinery `rapidfire train` uses. Outside Ray Train it is a single worker.

The dataset: a materialised Ray Dataset (call `.materialize()` on the driver, so every worker
sees the same rows in the same order) of tokenised rows with an `input_ids` column and, optionally,
`loss_mask` (1 where the loss counts; default everywhere).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import RapidfireError
from ..memory.estimate import MemoryModel, free_memory_bytes
from .loader import DynamicBatches, ShardLoader
from .sharding import ShardPlan, block_layout, realise


@dataclass(frozen=True)
class _Options:
    prefetch_depth: int = 3
    by_node: bool = True
    strategy: str = "fixed"
    batch_size: int = 8
    memory_threshold: float = 0.8
    max_tokens: int | None = None
    min: int | None = None
    max: int | None = None
    window: int = 1024
    max_padding: float = 0.05
    model: Any = None
    pad_id: int = 0
    seed: int = 0


class Pipeline:
    """A chain of data-layer steps over a Ray Dataset; each method returns a new pipeline."""

    def __init__(self, dataset, options: _Options | None = None):
        if "input_ids" not in dataset.columns():
            raise RapidfireError(f"pipeline: the dataset has no 'input_ids' column (columns: {dataset.columns()}); "
                                 "tokenise it first (e.g. with ds.map_batches)")
        self.dataset = dataset
        self.options = options or _Options()
        self._loader: ShardLoader | None = None
        self._epoch = 0

    def _with(self, **changes) -> Pipeline:
        return Pipeline(self.dataset, dataclasses.replace(self.options, **changes))

    def prefetch(self, depth: int = 3) -> Pipeline:
        """Prepare `depth` batches ahead of the step that needs them (Ray Data, background thread)."""
        if not 0 <= depth <= 64:
            raise RapidfireError(f"prefetch: depth {depth} is out of range; allowed: 0 .. 64")
        return self._with(prefetch_depth=depth)

    def shard_by_node(self, enabled: bool = True) -> Pipeline:
        """Give each worker rows from blocks on its own node where possible (always exactly once)."""
        return self._with(by_node=enabled)

    def batch(self, size: int, *, pad_id: int = 0, seed: int = 0) -> Pipeline:
        """Fixed batches of `size` rows, padded to the longest row (reshuffled each epoch)."""
        return self._with(strategy="fixed", batch_size=size, pad_id=pad_id, seed=seed)

    def dynamic_batch(self, *, memory_threshold: float | None = None, max_tokens: int | None = None,
                      model: torch.nn.Module | None = None, min: int | None = None,  # noqa: A002
                      max: int | None = None, window: int = 1024, max_padding: float = 0.05,  # noqa: A002
                      pad_id: int = 0, seed: int = 0) -> Pipeline:
        """Length-bucketed batches: with `max_tokens`, padded tokens per batch stay under it
        (token_budget); otherwise the batch size comes from free memory x `memory_threshold`
        (default 0.8) and the memory model of `model` (memory_aware), clamped to [min, max]."""
        if max_tokens is not None:
            if memory_threshold is not None:
                raise RapidfireError("dynamic_batch: give max_tokens (token budget) or memory_threshold "
                                     "(memory-aware), not both")
            return self._with(strategy="token_budget", max_tokens=max_tokens, max=max, window=window,
                              max_padding=max_padding, pad_id=pad_id, seed=seed)
        threshold = 0.8 if memory_threshold is None else memory_threshold
        if not 0.0 < threshold <= 1.0:
            raise RapidfireError(f"dynamic_batch: memory_threshold {threshold} is out of range; allowed: above 0 "
                                 "and at most 1 (e.g. 0.8)")
        if model is None:
            raise RapidfireError("dynamic_batch: memory-aware batching needs the model its memory is estimated "
                                 "from; pass model=..., or max_tokens=... for a token budget")
        if min is not None and max is not None and min > max:
            raise RapidfireError(f"dynamic_batch: min {min} is larger than max {max}; make min <= max")
        return self._with(strategy="memory_aware", memory_threshold=threshold, model=model, min=min, max=max,
                          window=window, max_padding=max_padding, pad_id=pad_id, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        """Each epoch visits every row once, in its own seeded order."""
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self.loader())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = self.loader()
        loader.set_epoch(self._epoch)
        return iter(loader)

    @property
    def stats(self) -> dict:
        """Rows, real and padded tokens served so far, and seconds the loop waited for data."""
        loader = self.loader()
        return {"rows": loader.rows_yielded, "tokens": loader.tokens_yielded,
                "padded_tokens": loader.padded_tokens_yielded, "data_wait_s": loader.wait_s}

    def loader(self) -> ShardLoader:
        """The worker's loader, built on first use (it needs the Ray Train context)."""
        if self._loader is None:
            self._loader = self._build()
        return self._loader

    def _build(self) -> ShardLoader:
        o = self.options
        rank, world, local_world = _train_context()
        ds = self.dataset
        num_rows = ds.count()
        if num_rows < world:
            raise RapidfireError(f"pipeline: {num_rows} rows cannot be shared by {world} workers")
        node_ids = _all_gather(_node_id()) if o.by_node and world > 1 else [None] * world
        if o.by_node and len(set(node_ids)) > 1:
            plan = ShardPlan.by_node(block_layout(ds, node_ids), node_ids, num_rows)
        else:
            plan = ShardPlan.contiguous(num_rows, world)
        shard = realise(ds, plan)[rank]
        if o.strategy != "fixed":
            cfg = {"data": {"max_length": 0, "dynamic_batch": {
                "strategy": o.strategy, "max_tokens": o.max_tokens, "min": o.min, "max": o.max, "window": o.window,
                "max_padding": o.max_padding, "memory_threshold": o.memory_threshold}},
                "train": {"per_device_batch_size": o.batch_size}}
            memory, free = None, 0
            if o.strategy == "memory_aware":
                memory = MemoryModel.for_model(o.model, world_size=world)
                device = next(o.model.parameters()).device
                # The model is already resident: count its weights back into what is free.
                free = free_memory_bytes(device, local_world) + memory.num_params * memory.param_bytes
                free = _all_reduce_min(free) if world > 1 else free
            try:
                dynamic = DynamicBatches.from_config(cfg, _row_lengths(ds), memory, free)
                rank_rows = [plan.rows(r) for r in range(world)]
                loader = ShardLoader(shard, num_rows=num_rows, rank=rank, world_size=world, batch_size=o.batch_size,
                                     pad_id=o.pad_id, prefetch_depth=o.prefetch_depth, seed=o.seed, budget=dynamic,
                                     rank_rows=rank_rows)
            except ValueError as e:
                raise RapidfireError(f"dynamic_batch: {e}") from None
            return loader
        return ShardLoader(shard, num_rows=num_rows, rank=rank, world_size=world, batch_size=o.batch_size,
                           pad_id=o.pad_id, prefetch_depth=o.prefetch_depth, seed=o.seed)


def pipeline(dataset) -> Pipeline:
    """Start a data-layer pipeline over a materialised, tokenised Ray Dataset."""
    return Pipeline(dataset)


def _row_lengths(ds) -> np.ndarray:
    """Token count of every row in dataset order (`num_tokens` if the dataset has it)."""
    column = "num_tokens" if "num_tokens" in ds.columns() else "input_ids"
    options = ds.context.execution_options
    kept, options.preserve_order = options.preserve_order, True
    try:
        parts = [b[column] if column == "num_tokens" else np.asarray([len(x) for x in b[column]])
                 for b in ds.iter_batches(batch_format="numpy", batch_size=None)]
    finally:
        options.preserve_order = kept
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def _train_context() -> tuple[int, int, int]:
    """(rank, world size, workers on this node); one worker outside Ray Train."""
    try:
        import ray.train

        ctx = ray.train.get_context()
        return ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size()
    except Exception:  # not inside a Ray Train worker
        return 0, 1, 1


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _all_gather(value) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _all_reduce_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())
