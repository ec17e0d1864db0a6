"""The reward stage's training step on the real TRL RewardTrainer (one process, tiny model): TRL's
pairwise loss on our batch layout, and an out-of-memory split that keeps pairs whole and gives the
same gradient as the whole batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import TrainerCallback

from rapidfire_ray.config import load_config
from rapidfire_ray.data.backoff import BatchDoesNotFit
from rapidfire_ray.data.preference import collate_pairs
from rapidfire_ray.models import load_reward_model, load_tokenizer
from rapidfire_ray.stages.reward import build_reward_trainer, reward_args
from rapidfire_ray.stages.base import WorkerParts
from rapidfire_ray.telemetry.timing import StepTimer
from paths import TINY_PROFILE


class Capture(TrainerCallback):
    def __init__(self):
        self.grads, self.logs = None, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def pairs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"chosen_ids": rng.integers(3, 250, int(rng.integers(4, 30))).astype(np.int32),
             "rejected_ids": rng.integers(3, 250, int(rng.integers(4, 30))).astype(np.int32)} for _ in range(n)]


def one_step(tmp_path, batches: list[dict], *, hook=None):
    plain = OmegaConf.to_container(load_config(TINY_PROFILE, {
        "train.max_steps": 1, "train.grad_clip": 0, "checkpoint.every_steps": 0, "train.stage": "reward",
        "data.format": "preference", "data.path": "jobs/data/preference_train.jsonl"}))
    tokenizer = load_tokenizer("tiny-random")
    model = load_reward_model("tiny-random", torch.float32, tokenizer.pad_token_id)
    if hook is not None:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    capture = Capture()
    sample = [{"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]}]
    trainer = build_reward_trainer(reward_args(plain, str(tmp_path), use_cpu=True), model, tokenizer,
                                   WorkerParts(loader=batches, timer=StepTimer()), sample, callbacks=[capture])
    trainer.train()
    return capture, trainer


def test_the_loss_is_trls_pairwise_loss_and_accuracy_is_logged(tmp_path):
    tokenizer = load_tokenizer("tiny-random")
    batch = collate_pairs(pairs(6), tokenizer.pad_token_id)
    capture, trainer = one_step(tmp_path, [batch])
    model = load_reward_model("tiny-random", torch.float32, tokenizer.pad_token_id)
    with torch.no_grad():
        chosen, rejected = torch.chunk(model(**batch).logits.squeeze(-1), 2)
    expected = -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    log = next(entry for entry in capture.logs if "loss" in entry)
    assert log["loss"] == pytest.approx(expected, rel=1e-4)
    assert log["accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert log["margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-4, abs=1e-6)


def test_out_of_memory_split_keeps_pairs_whole_and_the_gradient(tmp_path):
    tokenizer = load_tokenizer("tiny-random")
    data = pairs(5, seed=1)
    batch = collate_pairs(data, tokenizer.pad_token_id)
    reference, _ = one_step(tmp_path / "ref", [batch])
    seen: list[tuple] = []

    def oom_above_two_pairs(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[0] > 4:
            raise torch.OutOfMemoryError(f"injected: {ids.shape[0]} rows do not fit")
        chosen, rejected = torch.chunk(ids, 2)
        mask_c, mask_r = torch.chunk(kwargs["attention_mask"], 2)
        seen.extend((tuple(c[m.bool()].tolist()), tuple(r[n.bool()].tolist()))
                    for c, r, m, n in zip(chosen, rejected, mask_c, mask_r))

    capture, trainer = one_step(tmp_path / "oom", [batch], hook=oom_above_two_pairs)
    assert sorted(seen) == sorted((tuple(p["chosen_ids"].tolist()), tuple(p["rejected_ids"].tolist()))
                                  for p in data)  # each pair once, its two sides together
    assert reference.grads.keys() == capture.grads.keys()
    for name in reference.grads:
        torch.testing.assert_close(capture.grads[name], reference.grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert trainer.rf.backoff.events[0]["rows"] == 10


def test_a_single_pair_that_does_not_fit_fails_with_what_to_change(tmp_path):
    def always_oom(module, args, kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    tokenizer = load_tokenizer("tiny-random")
    with pytest.raises(BatchDoesNotFit, match=r"out of memory on a single sample \(2 rows\) of .* lower data.max_length"):
        one_step(tmp_path, [collate_pairs(pairs(2), tokenizer.pad_token_id)], hook=always_oom)
