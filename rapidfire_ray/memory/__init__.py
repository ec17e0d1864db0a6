"""The memory layer: a memory model of a training step, selective gradient checkpointing, int8
saved activations, allocator settings, precision, and the levels that combine them."""
from .activations import ActivationStats, Int8Activations, int8_saved_tensors, optimized_graph
from .estimate import MemoryModel, free_memory_bytes, memory_in_use_bytes

__all__ = ["ActivationStats", "Int8Activations", "MemoryModel", "free_memory_bytes", "int8_saved_tensors",
           "memory_in_use_bytes", "optimized_graph"]
