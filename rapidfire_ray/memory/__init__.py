"""The memory layer: a memory model of a training step (used by memory-aware batching)."""
from .estimate import MemoryModel, free_memory_bytes, memory_in_use_bytes

__all__ = ["MemoryModel", "free_memory_bytes", "memory_in_use_bytes"]
