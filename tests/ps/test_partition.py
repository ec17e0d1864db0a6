"""Partitioning: every parameter on exactly one shard, balanced by bytes, deterministic."""
from __future__ import annotations

import random

import pytest
import torch

from rapidfire_ray.ps import partition_parameters, shard_bytes


def _model_like(n=40, seed=0):
    rng = random.Random(seed)
    return {f"layer{i}.w": torch.empty(rng.choice([1, 7, 64, 300, 4096]), dtype=rng.choice([torch.float32, torch.bfloat16]))
            for i in range(n)}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 40])
def test_covers_every_parameter_once_and_balances(num_shards):
    params = _model_like()
    part = partition_parameters(params, num_shards)
    assert len(part) == num_shards and all(part)
    flat = [n for names in part for n in names]
    assert sorted(flat) == sorted(params) and len(flat) == len(set(flat))
    for names in part:  # order inside a shard is the model's order
        assert names == [n for n in params if n in set(names)]
    loads = shard_bytes(params, part)
    sizes = [t.numel() * t.element_size() for t in params.values()]
    assert sum(loads) == sum(sizes)
    assert max(loads) <= sum(sizes) / num_shards + max(sizes)  # greedy largest-first bound


def test_deterministic_and_accepts_sizes_or_pairs():
    params = _model_like(seed=3)
    by_tensor = partition_parameters(params, 4)
    assert partition_parameters(list(params.items()), 4) == by_tensor
    assert partition_parameters({n: t.numel() * t.element_size() for n, t in params.items()}, 4) == by_tensor


def test_equal_sizes_split_evenly_and_zero_sized_spread():
    assert [len(s) for s in partition_parameters({f"p{i}": 8 for i in range(9)}, 3)] == [3, 3, 3]
    part = partition_parameters({"big": 100, "z1": 0, "z2": 0}, 3)
    assert all(part)


def test_bad_input():
    with pytest.raises(ValueError, match="num_shards is 3 but the model has only 2 parameters"):
        partition_parameters({"a": 4, "b": 4}, 3)
    with pytest.raises(ValueError, match="num_shards must be an integer >= 1"):
        partition_parameters({"a": 4}, 0)
    with pytest.raises(ValueError, match="repeated: a"):
        partition_parameters([("a", 4), ("a", 8)], 1)
    with pytest.raises(ValueError, match="byte count"):
        partition_parameters({"a": -1}, 1)
