"""The NaN guard: a non-finite gradient skips the optimizer step (parameters unchanged), the batch
is recorded, and after `guard.max_consecutive` skipped steps in a row the run stops with a
diagnosis from the article's checklist (`diagnose.py`: learning rate above 5e-6, gradient
clipping missing or outside 0.5-1.0, abnormal tokens in the recorded batches).

Who decides that a step is skipped depends on the gradient exchange, because every worker must
agree (a worker that skips a collective its peers enter hangs them):
- plain DDP allreduce with AdamW: the guard itself. DDP averages gradients, so a NaN on one
  worker is a NaN on all of them after the exchange and every worker sees the same thing;
- `allreduce_compressed`, `rapidfire_adamw`, `parameter_server`: their own machinery already
  skips non-finite steps in agreement (`comm/training.py`); the guard counts those skips.
Under DeepSpeed ZeRO-3 the engine steps inside the backward and holds gradients in its own
partitions; the guard only counts there (DeepSpeed skips overflowing fp16 steps itself).
"""
from __future__ import annotations

import torch

from ..diagnose import Finding, check_grad_clip, check_learning_rate, check_token_rows
from ..errors import RapidfireError

KEPT_BATCHES = 4  # recorded batches of the current run of skipped steps (for the diagnosis)


class NanGuard:
    def __init__(self, *, max_consecutive: int, on_nonfinite: str, lr: float, grad_clip: float, vocab_size: int,
                 pad_id: int | None, checks_gradients: bool, rank: int = 0):
        self.max_consecutive = max_consecutive
        self.on_nonfinite = on_nonfinite
        self.lr, self.grad_clip = lr, grad_clip
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.checks_gradients = checks_gradients
        self.rank = rank
        self.skipped_steps = 0
        self.consecutive = 0
        self.batches: list[dict] = []  # the recorded batches of the current run of skips
        self.last_batch: dict | None = None

    @classmethod
    def for_run(cls, cfg: dict, model: torch.nn.Module, pad_id: int | None, rank: int) -> NanGuard:
        comm = cfg["communication"]
        plain = comm["mode"] == "allreduce" and cfg["optimizer"]["type"] == "adamw"
        return cls(max_consecutive=cfg["guard"]["max_consecutive"], on_nonfinite=comm["on_nonfinite"],
                   lr=cfg["optimizer"]["params"]["lr"], grad_clip=cfg["train"]["grad_clip"],
                   vocab_size=model.get_input_embeddings().num_embeddings, pad_id=pad_id,
                   checks_gradients=plain, rank=rank)

    def see_batch(self, inputs: dict) -> None:
        """The micro-batch the step trains on (kept by reference; copied only when recorded)."""
        self.last_batch = inputs

    def wrap(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, step_of, skips_elsewhere) -> None:
        """Guard `optimizer.step`. `step_of()`: the step being taken; `skips_elsewhere()`: how many
        steps the communication machinery has skipped so far."""
        step = optimizer.step

        def guarded_step(*args, **kwargs):
            before = skips_elsewhere()
            if self.checks_gradients and not _finite_gradients(model):
                optimizer.zero_grad(set_to_none=True)
                self.skipped(step_of())
                return None
            out = step(*args, **kwargs)
            if skips_elsewhere() > before:
                self.skipped(step_of())
            else:
                self.consecutive = 0
                self.batches.clear()
            return out

        optimizer.step = guarded_step

    def skipped(self, step: int) -> None:
        self.skipped_steps += 1
        self.consecutive += 1
        if self.last_batch is not None and len(self.batches) < KEPT_BATCHES:
            self.batches.append({k: v.detach().cpu().clone() for k, v in self.last_batch.items()
                                 if isinstance(v, torch.Tensor)})
        if self.on_nonfinite == "fail" or self.consecutive >= self.max_consecutive:
            raise RapidfireError(self.diagnosis(step))
        print(f"[rapidfire] rank {self.rank}: step {step} skipped: non-finite gradient "
              f"({self.consecutive} in a row; the run stops at guard.max_consecutive {self.max_consecutive})",
              flush=True)

    def findings(self) -> list[Finding]:
        found = [*check_learning_rate(self.lr), *check_grad_clip(self.grad_clip)]
        for batch in self.batches:
            found += check_token_rows(batch["input_ids"], vocab_size=self.vocab_size, pad_token_id=self.pad_id,
                                      attention_mask=batch.get("attention_mask"), labels=batch.get("labels"))
        return found

    def diagnosis(self, step: int) -> str:
        """One line: what happened, then the checklist's findings with their fixes."""
        found = self.findings()
        what = (f"{self.consecutive} step(s) in a row with a non-finite loss or gradient (last: step {step}; "
                f"{self.skipped_steps} skipped in all)")
        if not found:
            return (f"{what}; the checklist found nothing (learning rate, clipping and the recorded batches look "
                    "normal): try a lower optimizer.params.lr or train.precision fp32")
        unique = list(dict.fromkeys(f"{f.where}: {f.message} -> {f.fix}" for f in found))
        return f"{what}; likely causes: " + " | ".join(unique[:6])


def _finite_gradients(model: torch.nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
