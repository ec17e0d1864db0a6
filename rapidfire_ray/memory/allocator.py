"""Allocator settings against fragmentation (memory level2 and up).

Dynamic batches change shapes every step, which fragments a caching allocator: free memory
exists but not in one piece, and a step fails although it would fit. Two measures:
- CUDA: the caching allocator's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=
  expandable_segments:True`, set in the workers' environment before CUDA starts, unless the user
  set that variable), which grow one mapping instead of carving fixed-size blocks;
- on an out-of-memory error, `release_cached` hands cached blocks back (CUDA `empty_cache`; on
  CPU glibc's `malloc_trim`, which returns freed heap pages) and the step retries the same batch
  once before the dynamic batcher splits it (`stages/base.py`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import torch

CUDA_ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def worker_env() -> dict[str, str]:
    """Environment for the training workers (empty when the user chose allocator settings)."""
    return {} if os.environ.get(CUDA_ALLOC_ENV) else {CUDA_ALLOC_ENV: EXPANDABLE}


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        setting = os.environ.get(CUDA_ALLOC_ENV) or "default"
        return f"CUDA allocator {setting}; on out-of-memory: free cached blocks, retry once"
    return "CPU: on out-of-memory, return freed heap pages (malloc_trim) and retry once"


def release_cached(device: torch.device) -> None:
    """Give cached, unused memory back so that a retry finds it in one piece."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
