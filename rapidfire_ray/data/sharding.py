"""Exact, deterministic sharding of the training dataset across Ray Train workers.

Ray's default `streaming_split(equal=True)` drops up to `world_size - 1` rows per epoch and
assigns rows to ranks in arrival order, so neither "every row once" nor a deterministic resume
holds. This `DataConfig` cuts the (materialised) dataset into contiguous ranges whose sizes
differ by at most one row, `shard_bounds` below, and `ShardLoader` keeps the ranks in
lockstep by giving every rank the same number of batches.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from ray.train import DataConfig

TRAIN = "train"


def shard_bounds(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) row ranges, one per rank, covering every row once; sizes differ by <= 1."""
    return [(r * num_rows // world_size, (r + 1) * num_rows // world_size) for r in range(world_size)]


class ExactSplitDataConfig(DataConfig):
    """Split the `train` dataset into exact contiguous shards; other datasets go whole to each worker."""

    def __init__(self, **kwargs):
        super().__init__(datasets_to_split=[TRAIN], **kwargs)

    def configure(self, datasets, world_size: int, worker_handles, worker_node_ids: Optional[List[str]],
                  **kwargs) -> List[Dict[str, "object"]]:
        output: List[Dict[str, object]] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if name != TRAIN:
                for i in range(world_size):
                    output[i][name] = ds.iterator()
                continue
            bounds = shard_bounds(ds.count(), world_size)
            cuts = [end for _, end in bounds[:-1]]
            for i, part in enumerate(ds.split_at_indices(cuts) if cuts else [ds.copy(ds)]):
                # Blocks in a fixed order: the loader's seeded shuffle (and the batches a
                # resume skips) must see the same row sequence every time.
                part.context.execution_options.preserve_order = True
                output[i][name] = part.iterator()
        return output
