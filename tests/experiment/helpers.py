"""Tokenised sample rows and a plain config for the experiment tests (no Ray)."""
from __future__ import annotations

import json

from rapidfire_ray.config import load_config
from rapidfire_ray.data.tokenize import SFTTokenizer
from omegaconf import OmegaConf

from tests.paths import SAMPLE, TINY_PROFILE


def sample_rows(n: int, max_length: int = 128) -> list[dict]:
    """The first `n` rows of the SFT sample, tokenised by the project's own SFT tokenizer."""
    with open(SAMPLE, encoding="utf-8") as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    batch = {"source": ["sample"] * n, "messages": [""] * n, "text": [""] * n,
             "prompt": [r["prompt"] for r in records], "completion": [r["completion"] for r in records]}
    out = SFTTokenizer("tiny-random", "prompt_completion", max_length)(batch)
    return [{"input_ids": ids, "loss_mask": mask} for ids, mask in zip(out["input_ids"], out["loss_mask"])]


def plain_config(**overrides) -> dict:
    base = {"model.lora.r": 4, "model.lora.dropout": 0.1, "train.per_device_batch_size": 4,
            "optimizer.params.lr": 1e-2, "optimizer.params.weight_decay": 0.01, "train.lr_scheduler": "linear"}
    return OmegaConf.to_container(load_config(TINY_PROFILE, {**base, **overrides}), resolve=True)
