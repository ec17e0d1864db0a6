"""`optimizer.type: rapidfire_adamw`: the optimizer exchanges compressed momentum itself after its
warm-up (optim/rapidfire_adamw.py); DDP's hook averages gradients during the warm-up and sends
nothing afterwards. The optimizer skips a non-finite compressed step on every rank and clips by
an estimate of the averaged gradient's norm; its per-rank error feedback is saved here."""
from __future__ import annotations

import torch

from ..optim import RapidfireAdamW, default_freeze_step, local_gradient_hook
from .base import GradientExchange


class OneBitAdamExchange(GradientExchange):
    state_key = "optimizer"

    def __init__(self, compression: dict, *, freeze_step: int | None, total_steps: int, rank: int,
                 on_nonfinite: str = "skip", timer=None):
        super().__init__(rank=rank, on_nonfinite=on_nonfinite, timer=timer)
        self.codec, self.chunk_size = compression["grad"], compression["chunk_size"]
        self.freeze_step = freeze_step or default_freeze_step(total_steps)
        self.optimizer: RapidfireAdamW | None = None
        self._skipped_before = 0

    def build_optimizer(self, named_groups: list[dict], args) -> RapidfireAdamW:
        self.optimizer = RapidfireAdamW(named_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                        eps=args.adam_epsilon, weight_decay=args.weight_decay,
                                        freeze_step=self.freeze_step, codec=self.codec, chunk_size=self.chunk_size,
                                        stats=self.stats)
        self._part_built()
        return self.optimizer

    def register(self, ddp_model) -> None:
        ddp_model.register_comm_hook(self.optimizer, local_gradient_hook)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        # In the compressed stage each rank has only its local gradient: clip by the estimated
        # norm of the averaged one, the same on every rank (in the warm-up, exactly torch's clip).
        return self.optimizer.clip_grad_norm_(model.parameters(), max_norm)

    def _nonfinite_before_step(self, optimizer, model) -> None:
        self._skipped_before = self.optimizer.skipped_steps  # a resumed optimizer brings its count
        return None

    def _nonfinite_after_step(self) -> list[str] | None:
        return list(self.optimizer.nonfinite) if self.optimizer.skipped_steps > self._skipped_before else None

    def _untimed_phase(self) -> str | None:
        # The momentum exchange sits in the optimizer step (compressed stage); the warm-up hook
        # allreduces during backward without telling the step timer.
        if self.optimizer is None:
            return None
        return "optimizer" if self.optimizer.steps > self.optimizer.freeze_step else "backward"

    def _state_part(self) -> RapidfireAdamW | None:
        return self.optimizer

    def _save_part(self, part: RapidfireAdamW) -> dict:
        # optimizer.pt holds rank 0's error feedback only: every rank's buffers differ.
        return part.allreduce_state_dict()

    def _load_part(self, part: RapidfireAdamW, state: dict) -> None:
        part.load_allreduce_state_dict(state)
