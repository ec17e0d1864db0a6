"""What every stage's trainer shares: our dataloader seam and the step-phase timing."""
from __future__ import annotations

import time

from torch.nn.parallel import DistributedDataParallel

from ..telemetry.timing import StepTimer, timed_allreduce_hook


class RayStageMixin:
    """Mix into a TRL trainer class (before it in the bases). Set `rf_loader` and `rf_timer`
    before `train()`."""

    rf_loader = None
    rf_timer: StepTimer | None = None
    _rf_hooked = False
    _rf_forward_s = 0.0

    def get_train_dataloader(self):
        # TRL rejects Ray iterators as train_dataset, and a HF Dataset would be sharded a second
        # time by the Trainer: the Ray shard reaches the trainer here instead.
        return self.rf_loader

    def compute_loss(self, model, inputs, *args, **kwargs):
        t0 = time.perf_counter()
        with self.rf_timer.phase("forward"):
            out = super().compute_loss(model, inputs, *args, **kwargs)
        self._rf_forward_s += time.perf_counter() - t0
        return out

    def training_step(self, model, inputs, *args, **kwargs):
        if not self._rf_hooked and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.rf_timer, timed_allreduce_hook)
            self._rf_hooked = True
        self._rf_forward_s = 0.0
        with self.rf_timer.phase("backward"):
            loss = super().training_step(model, inputs, *args, **kwargs)
        # training_step = forward (timed in compute_loss) + backward; keep them apart.
        self.rf_timer.add("backward", -self._rf_forward_s)
        return loss
