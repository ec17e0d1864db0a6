"""The NaN guard on the real TRL trainer (one process, tiny model): a non-finite step is skipped with
the parameters unchanged; repeated ones stop the run with a diagnosis from the article's checklist."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rapidfire_ray.config import load_config
from rapidfire_ray.data.loader import collate
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.exchange import build_exchange
from rapidfire_ray.models import load_model, load_tokenizer
from rapidfire_ray.stages.guard import NanGuard
from rapidfire_ray.stages.sft import build_sft_trainer, sft_args
from rapidfire_ray.stages.base import WorkerParts
from rapidfire_ray.telemetry.timing import StepTimer
from paths import TINY_PROFILE


def rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 250, (int(torch.randint(8, 30, (1,), generator=g)),), generator=g)
        mask = torch.zeros(len(ids), dtype=torch.int8)
        mask[len(ids) // 3:] = 1
        out.append({"input_ids": ids.numpy(), "loss_mask": mask.numpy()})
    return out


class NanOnSteps:
    """A forward pre-hook that turns the input embeddings' output to NaN on chosen calls (1-based)."""

    def __init__(self, calls: set[int]):
        self.calls, self.n = calls, 0

    def __call__(self, module, args, output):
        self.n += 1
        return output * float("nan") if self.n in self.calls else output


def train(tmp_path, steps: int, nan_calls: set[int], *, lr: float = 3e-3, max_consecutive: int = 3, batches=None):
    cfg = OmegaConf.to_container(load_config(TINY_PROFILE, [
        f"train.max_steps={steps}", "train.grad_clip=1.0", "checkpoint.every_steps=0", "scaling.num_workers=1",
        f"optimizer.params.lr={lr}", f"guard.max_consecutive={max_consecutive}"]))
    torch.manual_seed(0)
    model = load_model("tiny-random", dtype=torch.float32)
    model.get_input_embeddings().register_forward_hook(NanOnSteps(nan_calls))
    tokenizer = load_tokenizer("tiny-random")
    batches = batches or [collate(rows(4, seed=s), 0) for s in range(steps)]
    parts = WorkerParts(loader=batches, timer=StepTimer(),
                        exchange=build_exchange(cfg["communication"], cfg["optimizer"], rank=0, total_steps=steps),
                        guard=NanGuard.for_run(cfg, model, tokenizer.pad_token_id, rank=0))
    trainer = build_sft_trainer(sft_args(cfg, str(tmp_path), use_cpu=True), model, tokenizer, parts,
                                [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], callbacks=[])
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trainer, model, start


def test_a_nan_step_is_skipped_and_leaves_the_parameters_unchanged(tmp_path):
    trainer, model, start = train(tmp_path, 1, {1})
    trainer.train()
    assert trainer.rf.guard.skipped_steps == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name]), name  # no update, no NaN written into the weights


def test_training_goes_on_after_an_isolated_nan_step(tmp_path):
    trainer, model, start = train(tmp_path, 3, {2})
    trainer.train()
    assert trainer.rf.guard.skipped_steps == 1 and trainer.rf.guard.consecutive == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())  # steps 1 and 3 trained


def test_repeated_nan_steps_stop_the_run_with_a_diagnosis(tmp_path):
    ids = torch.randint(3, 250, (3, 80), generator=torch.Generator().manual_seed(0))
    ids[0, :] = 7  # one token repeated over the whole row
    mask = torch.ones_like(ids)
    ids[2, :], mask[2, :] = 256, 0  # a row of padding only
    labels = torch.where(mask.bool(), ids, -100)
    bad = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    trainer, _, _ = train(tmp_path, 4, {1, 2, 3, 4}, lr=1e-3, max_consecutive=2, batches=[bad] * 4)
    with pytest.raises(RapidfireError) as e:
        trainer.train()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("2 step(s) in a row with a non-finite loss or gradient (last: step 2")
    assert "optimizer.params.lr" in msg and "200x" in msg  # lr 1e-3 flagged
    assert "token 7 repeats 80 times" in msg and "all padding" in msg


def test_a_rate_of_1e_3_is_flagged_even_when_the_batches_look_fine():
    guard = NanGuard(max_consecutive=1, lr=1e-3, grad_clip=0.0, vocab_size=259, pad_id=256)
    codes = {f.code for f in guard.findings()}
    assert {"lr_high", "clip_missing"} <= codes
