"""Data layer: files -> validated records (sources, formats) -> tokens (tokenize) in Ray Data
(pipeline) -> exact per-worker shards (sharding) -> padded batches for the trainer (loader)."""
