"""Selective gradient checkpointing: checkpoint only as many decoder blocks as the memory budget needs.

The plan checkpoints the smallest k blocks for which the memory model's peak fits the budget
(`fits=False` when even all do not), spread evenly over the stack, and is applied with
transformers' per-layer `gradient_checkpointing` flags. Why the first k that fits is the
cheapest, why the placement does not change the peak, and how the flags survive DDP:
docs/memory.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .estimate import GIB, MemoryModel


@dataclass(frozen=True)
class CheckpointPlan:
    num_layers: int
    layers: int  # decoder blocks checkpointed
    indices: tuple[int, ...]  # which ones (sorted)
    fits: bool  # the estimated peak is within the budget
    estimated_peak_bytes: int
    budget_bytes: int

    def describe(self) -> str:
        if self.layers == self.num_layers:
            which = " (all)"
        elif self.layers:
            which = f" (layers {', '.join(map(str, self.indices))})"
        else:
            which = ""
        verdict = "within" if self.fits else "over"
        return (f"checkpointing {self.layers} of {self.num_layers} decoder blocks{which}: estimated peak "
                f"{_size(self.estimated_peak_bytes)} {verdict} budget {_size(self.budget_bytes)}")


def plan_checkpointing(model: MemoryModel, budget_bytes: int, rows: int, width: int) -> CheckpointPlan:
    """The fewest checkpointed blocks with which a batch of `rows x width` tokens fits in `budget_bytes`."""
    return plan_for_batches(model, budget_bytes, [(rows, width)])


def plan_for_batches(model: MemoryModel, budget_bytes: int, batches: Iterable[tuple[int, int]]) -> CheckpointPlan:
    """The fewest checkpointed blocks with which every `(rows, width)` batch fits: the plan of the worst batch."""
    shapes = set(batches)
    if not shapes:
        raise ValueError("plan_for_batches needs at least one (rows, width) batch")
    for k in range(model.num_layers + 1):  # the peak falls with k: the first k that fits is the fewest
        peak = max(replace(model, checkpointed_layers=k).peak_bytes(r, w) for r, w in shapes)
        if peak <= budget_bytes:
            break
    return CheckpointPlan(num_layers=model.num_layers, layers=k, indices=spread_indices(k, model.num_layers),
                          fits=peak <= budget_bytes, estimated_peak_bytes=peak, budget_bytes=budget_bytes)


def spread_indices(k: int, num_layers: int) -> tuple[int, ...]:
    """`k` of `num_layers` block indices spread evenly (gaps differ by at most one), starting at 0."""
    if not 0 <= k <= num_layers:
        raise ValueError(f"cannot choose {k} of {num_layers} layers")
    return tuple(i * num_layers // k for i in range(k))


def apply_checkpointing(model: torch.nn.Module, indices: Iterable[int]) -> int:
    """Checkpoint exactly the decoder blocks at `indices` (0-based, in stack order) and no others; returns how many.

    Replaces whatever was in force before (an empty `indices` turns checkpointing off). Also sets
    `config.use_cache = False`: training needs no KV cache, and one would hold memory the estimate does not count.
    """
    model = _unwrap(model)
    layers = decoder_layers(model)
    chosen = set(indices)
    bad = sorted(i for i in chosen if not 0 <= i < len(layers))
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {len(layers)} decoder layers")
    model.config.use_cache = False
    if not chosen:
        model.activation_checkpointing_disable()
        return 0
    model.disable_input_require_grads()  # enabling adds the embedding hook again: keep one, not one per call
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in chosen
    return len(chosen)


def checkpointed_indices(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder blocks under gradient checkpointing now."""
    return [i for i, layer in enumerate(decoder_layers(_unwrap(model))) if layer.gradient_checkpointing]


def decoder_layers(model: torch.nn.Module) -> list[GradientCheckpointingLayer]:
    """The model's checkpointable blocks in stack order (the order transformers numbers them in)."""
    return [m for m in _unwrap(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "config") and hasattr(model, "module"):  # DDP / FSDP wrappers
        model = model.module
    return model


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
