"""What every stage's trainer shares: our dataloader seam and the step-phase timing."""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from ..telemetry.timing import StepTimer, timed_allreduce_hook


class RayStageMixin:
    """Mix into a TRL trainer class (before it in the bases). Set `rf_loader` and `rf_timer`
    before `train()`."""

    rf_loader = None
    rf_timer: StepTimer | None = None
    _rf_hooked = False

    def get_train_dataloader(self):
        # TRL rejects Ray iterators as train_dataset, and a HF Dataset would be sharded a second
        # time by the Trainer: the Ray shard reaches the trainer here instead.
        return self.rf_loader

    def compute_loss(self, model, inputs, *args, **kwargs):
        with self.rf_timer.phase("forward"):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        if not self._rf_hooked and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.rf_timer, timed_allreduce_hook)
            self._rf_hooked = True
        forward_before = self.rf_timer.seconds("forward")
        with self.rf_timer.phase("backward"):
            loss = super().training_step(model, inputs, *args, **kwargs)
        # training_step = forward (timed in compute_loss) + backward; keep them apart.
        self.rf_timer.add("backward", forward_before - self.rf_timer.seconds("forward"))
        return loss
