"""The training step on the real TRL trainer (one process, tiny model): the loss is normalised per
token across variable batches, and an out-of-memory error splits the batch and retries it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import TrainerCallback

from rapidfire_ray.config import load_config
from rapidfire_ray.data.backoff import BatchDoesNotFit, split_batch
from rapidfire_ray.data.loader import collate
from rapidfire_ray.models import load_model, load_tokenizer
from rapidfire_ray.stages.sft import build_sft_trainer, sft_args
from rapidfire_ray.stages.base import WorkerParts
from rapidfire_ray.telemetry.timing import StepTimer
from paths import TINY_PROFILE


class GradCapture(TrainerCallback):
    """The accumulated gradients just before the optimizer step (clipping is off)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of different lengths with completion-only loss masks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(6, 40))
        ids = rng.integers(3, 250, length).astype(np.int32)
        mask = np.zeros(length, np.int8)
        mask[length // 3:] = 1
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def one_step(tmp_path, batches: list[dict], grad_accum: int, *, hook=None):
    """Train one optimizer step over `batches` (micro-batches); return the gradients it applied."""
    plain = OmegaConf.to_container(load_config(TINY_PROFILE, ["train.max_steps=1",
                                                              f"train.gradient_accumulation_steps={grad_accum}",
                                                              "train.grad_clip=0", "checkpoint.every_steps=0"]))
    torch.manual_seed(0)
    model = load_model("tiny-random", dtype=torch.float32)
    if hook is not None:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    capture = GradCapture()
    sample = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    trainer = build_sft_trainer(sft_args(plain, str(tmp_path), use_cpu=True), model, load_tokenizer("tiny-random"),
                                WorkerParts(loader=batches, timer=StepTimer()), sample, callbacks=[capture])
    trainer.train()
    return capture.grads, trainer


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dynamic_micro_batches_give_the_same_gradient_as_one_fixed_batch(tmp_path):
    data = rows(10)
    fixed, _ = one_step(tmp_path / "fixed", [collate(data, 0)], 1)
    # The same rows cut by length into batches of 3, 4 and 3 rows with different padded widths.
    order = sorted(range(10), key=lambda i: len(data[i]["input_ids"]))
    dynamic = [collate([data[i] for i in order[a:b]], 0) for a, b in ((0, 3), (3, 7), (7, 10))]
    assert len({b["input_ids"].shape[1] for b in dynamic}) == 3
    grads, _ = one_step(tmp_path / "dynamic", dynamic, 3)
    assert_same_grads(fixed, grads)


def test_out_of_memory_splits_the_batch_retries_and_trains_every_row_once(tmp_path):
    data = rows(7, seed=1)
    batch = collate(data, 0)
    reference, _ = one_step(tmp_path / "ref", [batch], 1)
    trained: list[tuple] = []

    def oom_above_two_rows(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[0] > 2:
            raise torch.OutOfMemoryError(f"injected: {ids.shape[0]} rows do not fit")
        trained.extend(tuple(r[m.bool()].tolist()) for r, m in zip(ids, kwargs["attention_mask"]))

    grads, trainer = one_step(tmp_path / "oom", [batch], 1, hook=oom_above_two_rows)
    assert sorted(trained) == sorted(tuple(r["input_ids"].tolist()) for r in data)  # each row once
    assert_same_grads(reference, grads)
    events = trainer.rf.backoff.events
    assert events[0]["rows"] == 7 and all(e["step"] == 1 for e in events)
    assert trainer.rf.backoff.ceiling <= batch["input_ids"].numel() // 4


def test_a_single_row_that_does_not_fit_fails_with_what_to_change(tmp_path):
    def always_oom(module, args, kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(BatchDoesNotFit, match="out of memory on a single row of .* lower data.max_length"):
        one_step(tmp_path, [collate(rows(2), 0)], 1, hook=always_oom)


def test_split_batch_trims_each_piece_to_its_longest_row():
    batch = collate([{"input_ids": np.arange(1, n + 1), "loss_mask": np.ones(n, np.int8)} for n in (3, 4, 9, 10)], 0)
    a, b = split_batch(batch, 2)
    assert a["input_ids"].shape == (2, 4) and b["input_ids"].shape == (2, 10)
    assert torch.equal(torch.cat([a["labels"][:, :4], b["labels"][:, :4]]), batch["labels"][:, :4])
