"""Fixtures of the RL tests: a tiny-random sequence classifier saved as a reward model."""
from __future__ import annotations

import pytest


def save_tiny_reward_model(path: str, seed: int = 1) -> str:
    """A randomly initialised LlamaForSequenceClassification (num_labels 1) with tiny-random's
    tokenizer, saved as a Hugging Face checkpoint (what the reward stage writes)."""
    import torch
    from transformers import LlamaForSequenceClassification

    from rapidfire_ray.models import tiny

    tokenizer = tiny.build_tokenizer()
    config = tiny.build_config(len(tokenizer))
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> str:
    return save_tiny_reward_model(str(tmp_path_factory.mktemp("reward") / "model"))
