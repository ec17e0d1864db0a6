"""Starting parameter-server shards as Ray actors: `remote_shard` (the actor class, restarted
without limit) and `launch_shards` (partition the parameters, one actor per shard)."""
from __future__ import annotations

import torch

from .shard import ParameterShard


def remote_shard(*, num_cpus: float = 0.25, max_restarts: int = -1, max_task_retries: int = -1, **options):
    """`ParameterShard` as a Ray actor class. Restarts are unlimited by default (a shard is
    state the run cannot go on without; it comes back from its snapshot), and calls in flight
    when it dies are retried on the restarted actor (pushes are deduplicated by `seq`; pulls
    are safe to repeat)."""
    import ray

    return ray.remote(ParameterShard).options(num_cpus=num_cpus, max_restarts=max_restarts,
                                              max_task_retries=max_task_retries, **options)


def launch_shards(named_parameters, num_shards: int, *, snapshot_dir: str | None = None,
                  scheduling_strategy="SPREAD", num_cpus: float = 0.25, name_prefix: str | None = None,
                  **shard_kwargs):
    """Partition `named_parameters` and start one actor per shard, spread across nodes.
    Returns (handles, partition, pinned). `shard_kwargs` go to `ParameterShard` (codec,
    codec_opts, max_staleness, snapshot_every, optimizer, lr_staleness_scaling, lease_s).

    Keep `pinned` (object-store references to each shard's initial parameters) as long as the
    shards may restart: Ray re-runs `__init__` with the same arguments, and arguments that left
    the object store make the restart fail (ray-project/ray#53727)."""
    import ray

    from .partition import partition_parameters

    params = dict(named_parameters)
    partition = partition_parameters(params, num_shards)
    handles, pinned = [], []
    for i, names in enumerate(partition):
        opts = {"scheduling_strategy": scheduling_strategy}
        if name_prefix:
            opts["name"] = f"{name_prefix}-{i}"
        cls = remote_shard(num_cpus=num_cpus, **opts)
        pinned.append(ray.put({n: params[n].detach().to("cpu", torch.float32) for n in names}))
        handles.append(cls.remote(i, pinned[-1], snapshot_dir=snapshot_dir, **shard_kwargs))
    return handles, partition, pinned
