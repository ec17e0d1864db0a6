"""The article's train_config.yaml loads as written and means what the article says."""
from __future__ import annotations

import os

import pytest

from paths import REPO
from rapidfire_ray.config import load_config
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.memory.levels import MemoryOptions

ARTICLE = os.path.join(REPO, "jobs", "configs", "article.yaml")


def test_the_articles_profile_loads_with_its_values():
    cfg = load_config(ARTICLE)
    assert cfg.optimizer.type == "rapidfire_adamw" and cfg.optimizer.params.lr == pytest.approx(5e-6)
    assert cfg.optimizer.params.compression.grad == "1bit" and cfg.optimizer.params.compression.act == "int8"
    assert cfg.data.dynamic_batch.strategy == "memory_aware"
    assert (cfg.data.dynamic_batch.min, cfg.data.dynamic_batch.max, cfg.data.prefetch_depth) == (4, 32, 3)
    options = MemoryOptions.from_config(cfg)
    assert options.act == "int8" and not options.checkpointing  # act: int8 at level0 compresses only
    assert MemoryOptions.from_config(load_config(ARTICLE, ["memory.optim_level=level2"])).checkpointing


def test_the_articles_command_line_runs_and_level3_is_refused_with_the_reason():
    # `--communication allreduce_compressed` with rapidfire_adamw: its compressed momentum exchange
    cfg = load_config(ARTICLE, ["communication.mode=allreduce_compressed", "memory.optim_level=level2"])
    assert cfg.communication.mode == "allreduce_compressed" and cfg.optimizer.type == "rapidfire_adamw"
    # `--memory_optim level3`: ZeRO-3 exchanges gradients itself.
    with pytest.raises(RapidfireError, match="cannot be combined with optimizer.type rapidfire_adamw"):
        load_config(ARTICLE, ["memory.optim_level=level3", "communication.mode=allreduce_compressed"])
    with pytest.raises(RapidfireError, match="cannot be combined with communication.mode allreduce_compressed"):
        load_config(ARTICLE, ["memory.optim_level=level3", "optimizer.type=adamw",
                              "communication.mode=allreduce_compressed"])
