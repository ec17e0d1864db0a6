"""The memory layer: a memory model of a training step, selective gradient checkpointing, int8
saved activations, allocator settings, precision, and the levels that combine them.

The names below load their module when first used: the driver imports `memory.estimate` and
`memory.levels` without the activation hooks, which pull in transformers' model stack."""
from __future__ import annotations

import importlib

_HOME = {"ActivationStats": "activations", "Int8Activations": "activations", "int8_saved_tensors": "activations",
         "optimized_graph": "activations", "MemoryModel": "estimate", "free_memory_bytes": "estimate",
         "memory_in_use_bytes": "estimate"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
