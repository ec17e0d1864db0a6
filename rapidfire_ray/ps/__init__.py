"""Parameter server (`communication.mode: parameter_server`): sharded Ray actors that own the
parameters' float32 master copy and optimizer state and apply compressed updates as they
arrive; workers push compressed gradients and pull compressed deltas (see shard.py, client.py
and docs/parameter_server.md).
"""
from .client import PSClient
from .launch import launch_shards, remote_shard
from .partition import partition_parameters, shard_bytes
from .shard import LR_SCALINGS, ParameterShard
from .snapshots import snapshot_path

__all__ = ["LR_SCALINGS", "PSClient", "ParameterShard", "launch_shards", "partition_parameters",
           "remote_shard", "shard_bytes", "snapshot_path"]
