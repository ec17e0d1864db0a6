"""The Python surface: pipeline(ds).prefetch().shard_by_node().dynamic_batch() in a plain PyTorch
loop inside real Ray Train workers."""
from __future__ import annotations

import json

import numpy as np
import pytest

import rapidfire_ray
from rapidfire_ray.errors import RapidfireError


def token_rows(n: int) -> list[dict]:
    rng = np.random.default_rng(3)
    # Row i starts with the marker tokens (i // 200 + 1, i % 200 + 1) so each row can be told apart.
    return [{"input_ids": np.concatenate([[i // 200 + 1, i % 200 + 1],
                                          rng.integers(3, 250, int(rng.integers(2, 60)))]).astype(np.int32)}
            for i in range(n)]


def test_pipeline_in_a_plain_torch_loop_on_two_workers(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        import ray.train
        import torch

        from rapidfire_ray.models import load_model

        rank = ray.train.get_context().get_world_rank()
        model = ray.train.torch.prepare_model(load_model("tiny-random", dtype=torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = (rapidfire_ray.data.pipeline(config["ds"]).prefetch(2).shard_by_node()
                   .dynamic_batch(memory_threshold=0.5, model=model, min=2, max=16))
        seen, sizes, losses = [], [], []
        for epoch in range(2):
            batches.set_epoch(epoch)
            for batch in batches:
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss))
                sizes.append(len(batch["input_ids"]))
                seen += [(epoch, int(r[0]), int(r[1])) for r in batch["input_ids"]]
        with open(f"{config['out']}/rank{rank}.json", "w") as f:
            json.dump({"seen": seen, "sizes": sizes, "batches": len(batches), "stats": batches.stats}, f)

    n = 301
    ds = ray_cluster.data.from_items(token_rows(n)).materialize()
    TorchTrainer(loop, train_loop_config={"ds": ds, "out": str(tmp_path)},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="api", storage_path=str(tmp_path / "storage"))).fit()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["batches"] == results[1]["batches"]
    assert len(results[0]["sizes"]) == len(results[1]["sizes"]) == 2 * results[0]["batches"]
    assert all(2 <= s <= 16 for r in results for s in r["sizes"])
    expected = sorted((e, i // 200 + 1, i % 200 + 1) for e in range(2) for i in range(n))
    assert sorted(tuple(x) for r in results for x in r["seen"]) == expected  # every row once per epoch
    assert results[0]["stats"]["rows"] + results[1]["stats"]["rows"] == 2 * n


def test_pipeline_errors_name_the_fix(ray_cluster):
    ds = ray_cluster.data.from_items([{"text": "a"}])
    with pytest.raises(RapidfireError, match="no 'input_ids' column"):
        rapidfire_ray.data.pipeline(ds)
    p = rapidfire_ray.data.pipeline(ray_cluster.data.from_items(token_rows(4)))
    with pytest.raises(RapidfireError, match="needs the model"):
        p.dynamic_batch(memory_threshold=0.8)
    with pytest.raises(RapidfireError, match="memory_threshold 0 is out of range"):
        p.dynamic_batch(memory_threshold=0, model=object())
    with pytest.raises(RapidfireError, match="not both"):
        p.dynamic_batch(memory_threshold=0.8, max_tokens=100)


def test_pipeline_outside_ray_train_is_one_worker_with_a_token_budget(ray_cluster):
    ds = ray_cluster.data.from_items(token_rows(50)).materialize()
    batches = rapidfire_ray.data.pipeline(ds).prefetch(0).dynamic_batch(max_tokens=128)
    got = [b for b in batches]
    assert sum(len(b["input_ids"]) for b in got) == 50
    assert all(b["input_ids"].numel() <= 128 for b in got)
