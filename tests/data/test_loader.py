"""Exact sharding and the loader seam: every row once per epoch, ranks in lockstep, resume skip."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from rapidfire_ray.data.loader import ShardLoader, batch_plan, batches_per_epoch, collate
from rapidfire_ray.data.sharding import TRAIN, ExactSplitDataConfig, shard_bounds
from loader_checks import epoch_sources


def rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 12))
        out.append({"input_ids": np.arange(1, length + 1, dtype=np.int32),
                    "loss_mask": np.r_[np.zeros(2, np.int8), np.ones(length - 2, np.int8)],
                    "source": f"f.jsonl:{i + 1}"})
    return out


@pytest.mark.parametrize("n, world", [(10, 2), (11, 2), (7, 3), (5, 5), (1000, 7)])
def test_shard_bounds_cover_every_row_once_and_differ_by_at_most_one(n, world):
    bounds = shard_bounds(n, world)
    covered = [i for s, e in bounds for i in range(s, e)]
    assert covered == list(range(n))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n, world, batch", [(9, 2, 4), (8, 2, 4), (11, 2, 1), (7, 3, 2), (100, 4, 8)])
def test_batch_plan_is_lockstep_and_exact(n, world, batch):
    s = batches_per_epoch(n, world, batch)
    for start, end in shard_bounds(n, world):
        plan = batch_plan(end - start, s, batch)
        assert len(plan) == s and sum(plan) == end - start
        assert all(1 <= b <= batch + 1 for b in plan) and all(b == batch for b in plan[:-1])


def test_collate_pads_right_and_masks_prompt_and_padding():
    batch = collate([{"input_ids": np.array([5, 6, 7]), "loss_mask": np.array([0, 1, 1])},
                     {"input_ids": np.array([8]), "loss_mask": np.array([1])}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["labels"].dtype == torch.long


def shard_iterators(ray, n: int, world: int):
    ds = ray.data.from_items(rows(n)).materialize()
    return [its[TRAIN] for its in ExactSplitDataConfig().configure({TRAIN: ds}, world, None, None)]


@pytest.mark.parametrize("n, world, batch", [(11, 2, 4), (12, 3, 1), (9, 2, 3)])
def test_loaders_use_every_row_once_per_epoch_in_lockstep(ray_cluster, n, world, batch):
    loaders = [ShardLoader(it, num_rows=n, rank=r, world_size=world, batch_size=batch, pad_id=0, seed=1,
                           with_sources=True) for r, it in enumerate(shard_iterators(ray_cluster, n, world))]
    assert len({len(loader) for loader in loaders}) == 1
    for epoch in range(2):
        assert epoch_sources(loaders, epoch) == Counter(f"f.jsonl:{i + 1}" for i in range(n))


def test_epochs_reshuffle_deterministically_and_resume_skips_exactly(ray_cluster):
    [it] = shard_iterators(ray_cluster, 40, 1)
    loader = ShardLoader(it, num_rows=40, rank=0, world_size=1, batch_size=4, pad_id=0, seed=3, with_sources=True)
    order = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        order[epoch] = [b["sources"] for b in loader]
    assert order[0] != order[1]
    loader.set_epoch(1)
    loader.skip_next(3)
    assert [b["sources"] for b in loader] == order[1][3:]  # same order, first 3 batches skipped
    loader.set_epoch(1)
    assert [b["sources"] for b in loader] == order[1]  # the skip applies once


def test_too_few_rows_for_workers_is_refused(ray_cluster):
    [it, _, _] = shard_iterators(ray_cluster, 3, 3)
    with pytest.raises(ValueError, match="2 training rows cannot be shared by 3 workers"):
        ShardLoader(it, num_rows=2, rank=0, world_size=3, batch_size=1, pad_id=0)


def test_ray_train_workers_see_every_row_exactly_once(ray_cluster, tmp_path):
    """Real Ray Train, 2 workers, get_dataset_shard through our DataConfig, an odd row count."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        import ray.train

        ctx = ray.train.get_context()
        loader = ShardLoader(ray.train.get_dataset_shard(TRAIN), num_rows=config["n"], rank=ctx.get_world_rank(),
                             world_size=ctx.get_world_size(), batch_size=4, pad_id=0, with_sources=True)
        sources = [s for b in loader for s in b["sources"]]
        with open(f"{config['out']}/rank{ctx.get_world_rank()}.json", "w") as f:
            json.dump({"sources": sources, "batches": len(loader)}, f)

    n = 37
    trainer = TorchTrainer(loop, train_loop_config={"n": n, "out": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="sharding", storage_path=str(tmp_path / "storage")),
                           datasets={TRAIN: ray_cluster.data.from_items(rows(n)).materialize()},
                           dataset_config=ExactSplitDataConfig())
    trainer.fit()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    seen = Counter(s for r in results for s in r["sources"])
    assert seen == Counter(f"f.jsonl:{i + 1}" for i in range(n))
    assert results[0]["batches"] == results[1]["batches"] == 5
    assert not set(results[0]["sources"]) & set(results[1]["sources"])
