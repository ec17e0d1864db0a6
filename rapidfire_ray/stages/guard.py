"""The NaN guard: counts the optimizer steps the gradient exchange skipped for a non-finite
gradient (exchange/base.py decides, in agreement on every worker), records their batches, and
after `guard.max_consecutive` skipped steps in a row (or at the first one under
`communication.on_nonfinite: fail`) stops the run with a diagnosis from the article's checklist
(`diagnose.py`: learning rate above 5e-6, gradient clipping missing or outside 0.5-1.0,
abnormal tokens in the recorded batches). Under DeepSpeed ZeRO-3 the engine steps inside the
backward and holds gradients in its own partitions; nothing is skipped there (DeepSpeed skips
overflowing fp16 steps itself).
"""
from __future__ import annotations

import torch

from ..diagnose import Finding, check_grad_clip, check_learning_rate, check_token_rows
from ..errors import RapidfireError
from ..exchange.base import GradientExchange, NonFiniteStep
from ..log import warn

KEPT_BATCHES = 4  # recorded batches of the current run of skipped steps (for the diagnosis)


class NanGuard:
    def __init__(self, *, max_consecutive: int, lr: float, grad_clip: float, vocab_size: int, pad_id: int | None,
                 rank: int = 0):
        self.max_consecutive = max_consecutive
        self.lr, self.grad_clip = lr, grad_clip
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.rank = rank
        self.skipped_steps = 0
        self.consecutive = 0
        self.batches: list[dict] = []  # the recorded batches of the current run of skips
        self.last_batch: dict | None = None

    @classmethod
    def for_run(cls, cfg: dict, model: torch.nn.Module, pad_id: int | None, rank: int) -> NanGuard:
        return cls(max_consecutive=cfg["guard"]["max_consecutive"], lr=cfg["optimizer"]["params"]["lr"],
                   grad_clip=cfg["train"]["grad_clip"], vocab_size=model.get_input_embeddings().num_embeddings,
                   pad_id=pad_id, rank=rank)

    def see_batch(self, inputs: dict) -> None:
        """The micro-batch the step trains on (kept by reference; copied only when recorded)."""
        self.last_batch = inputs

    def wrap(self, optimizer: torch.optim.Optimizer, step_of, exchange: GradientExchange) -> None:
        """Watch `optimizer.step` (already guarded by `exchange`). `step_of()`: the step being taken."""
        step = optimizer.step

        def watched_step(*args, **kwargs):
            before = exchange.skipped_steps
            try:
                out = step(*args, **kwargs)
            except NonFiniteStep as e:  # communication.on_nonfinite: fail
                self.skipped(step_of(), names=e.names, fail=True)  # raises the diagnosis
            if exchange.skipped_steps > before:
                self.skipped(step_of())
            else:
                self.consecutive = 0
                self.batches.clear()
            return out

        optimizer.step = watched_step

    def skipped(self, step: int, *, names: list[str] | None = None, fail: bool = False) -> None:
        self.skipped_steps += 1
        self.consecutive += 1
        if self.last_batch is not None and len(self.batches) < KEPT_BATCHES:
            self.batches.append({k: v.detach().cpu().clone() for k, v in self.last_batch.items()
                                 if isinstance(v, torch.Tensor)})
        if fail or self.consecutive >= self.max_consecutive:
            raise RapidfireError(self.diagnosis(step, names))
        warn(f"rank {self.rank}: step {step} skipped: non-finite gradient "
             f"({self.consecutive} in a row; the run stops at guard.max_consecutive {self.max_consecutive})")

    def findings(self) -> list[Finding]:
        found = [*check_learning_rate(self.lr), *check_grad_clip(self.grad_clip)]
        for batch in self.batches:
            found += check_token_rows(batch["input_ids"], vocab_size=self.vocab_size, pad_token_id=self.pad_id,
                                      attention_mask=batch.get("attention_mask"), labels=batch.get("labels"))
        return found

    def diagnosis(self, step: int, names: list[str] | None = None) -> str:
        """One line: what happened, then the checklist's findings with their fixes."""
        found = self.findings()
        where = f" in {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names else ""
        what = (f"{self.consecutive} step(s) in a row with a non-finite loss or gradient (last: step {step}{where}; "
                f"{self.skipped_steps} skipped in all)")
        if not found:
            return (f"{what}; the checklist found nothing (learning rate, clipping and the recorded batches look "
                    "normal): try a lower optimizer.params.lr or train.precision fp32")
        unique = list(dict.fromkeys(f"{f.where}: {f.message} -> {f.fix}" for f in found))
        return f"{what}; likely causes: " + " | ".join(unique[:6])

