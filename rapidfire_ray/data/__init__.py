"""Data layer: files -> validated records (sources, formats) -> tokens (tokenize) in Ray Data
(prepare) -> exact per-worker shards, by node (sharding) -> fixed or dynamic batches (batching,
backoff) -> padded, prefetched batches for the trainer (loader). `pipeline(ds)` (api) is the
same machinery for users' own loops."""

from .api import Pipeline, pipeline

__all__ = ["Pipeline", "pipeline"]
