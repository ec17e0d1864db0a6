"""Split named parameters into `num_shards` groups balanced by bytes.

Greedy largest-first (LPT): parameters in decreasing size (ties: the order given), each to the
shard holding the fewest bytes so far (ties: the lowest shard index). Deterministic for the same
names and sizes, so every worker and every shard computes the same partition without talking.
The largest shard holds at most the mean plus the largest single parameter (and at most 4/3 of
the best possible split). Inside a shard, parameters keep the order they were given in.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

import torch

SizeLike = int | torch.Tensor


def _nbytes(name: str, value: SizeLike) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"partition: size of {name!r} must be a tensor or a byte count >= 0, got {value!r}")
    return value


def partition_parameters(params: Mapping[str, SizeLike] | Iterable[tuple[str, SizeLike]],
                         num_shards: int) -> list[list[str]]:
    """`num_shards` lists of parameter names, every name in exactly one, balanced by bytes.

    `params`: name -> tensor (bytes = numel * element_size) or name -> byte count, or
    (name, tensor) pairs such as `model.named_parameters()`. Every shard gets at least one
    parameter; more shards than parameters is a ValueError."""
    items = list(params.items() if isinstance(params, Mapping) else params)
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"partition: num_shards must be an integer >= 1, got {num_shards!r}")
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"partition: parameter names must be unique; repeated: {', '.join(dup)}")
    if num_shards > len(items):
        raise ValueError(f"communication.ps.num_shards is {num_shards} but the model has only {len(items)} "
                         f"parameters; choose num_shards <= {len(items)}")
    sizes = {name: _nbytes(name, value) for name, value in items}
    order = {name: i for i, name in enumerate(names)}
    # (bytes so far, parameters so far, shard index): the count keeps zero-byte parameters from
    # piling onto one shard, so every shard gets at least one parameter.
    heap = [(0, 0, shard) for shard in range(num_shards)]
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: (-sizes[n], order[n])):
        load, count, shard = heapq.heappop(heap)
        owner[name] = shard
        heapq.heappush(heap, (load + sizes[name], count + 1, shard))
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    for name in names:
        shards[owner[name]].append(name)
    return shards


def shard_bytes(params: Mapping[str, SizeLike], partition: list[list[str]]) -> list[int]:
    """Bytes per shard of a partition."""
    return [sum(_nbytes(n, params[n]) for n in names) for names in partition]
