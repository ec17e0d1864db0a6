"""Data layer: files -> validated records (sources, formats) -> tokens (tokenize) in Ray Data
(prepare) -> exact per-worker shards, by node (sharding) -> fixed or dynamic batches (batching,
backoff) -> padded, prefetched batches for the trainer (loader). `pipeline(ds)` (api) is the
same machinery for users' own loops."""

__all__ = ["Pipeline", "pipeline"]


def __getattr__(name: str):
    # Lazy: Ray Data tasks import modules of this package (sources, tokenize) and must not pay for
    # torch, transformers models and Ray Train, which `api` pulls in.
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
