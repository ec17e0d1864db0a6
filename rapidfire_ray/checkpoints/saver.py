"""The trainer callback that saves: on schedule and at the last step, each rank's part of the
checkpoint (the shard plan, an elastic run's data position, the gradient exchange's state, the
manifest), reported to Ray Train, which merges the ranks' folders into one checkpoint."""
from __future__ import annotations

import contextlib
import os

import ray.train
from transformers import TrainerCallback

from ..atomic import atomic_write_json
from ..data.elastic import write_position
from .manifest import SHARD_PLAN_FILE, write_manifest


class CheckpointSaver(TrainerCallback):
    """Placed after the callbacks that may ask for a save (preemption) and before the step
    recorder, so the exchange's pre-save work (`before_save`) is in the step that saves."""

    def __init__(self, *, rank: int, every_steps: int, loader, exchange=None, shard_plan: dict | None = None):
        self.rank = rank
        self.every_steps = every_steps
        self.loader = loader
        self.exchange = exchange  # exchange.GradientExchange: its per-rank state and run course
        self.shard_plan = shard_plan  # saved with every checkpoint: a resume reads the same shards
        self._last_loss = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.exchange is not None:
            self.exchange.begin()  # (parameter server) take the shards' parameters

    def on_step_end(self, args, state, control, **kwargs):
        # Save on schedule and always at the last step (transformers only saves on the schedule).
        if state.global_step >= state.max_steps or (self.every_steps and state.global_step % self.every_steps == 0):
            control.should_save = True
        if getattr(self.loader, "finished", False):  # an elastic run's stream handed out its last epoch
            control.should_save = control.should_training_stop = True
        if control.should_save and self.exchange is not None:
            self.exchange.before_save()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._last_loss = float(logs["loss"])

    def on_save(self, args, state, control, **kwargs):
        # Every rank reports its own checkpoint folder (rank 0: model, optimizer, state; others:
        # their RNG state); Ray Train merges them into one checkpoint on the run's storage.
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.rank == 0 and self.shard_plan is not None and os.path.isdir(path):
            atomic_write_json(os.path.join(path, SHARD_PLAN_FILE), self.shard_plan)
        if hasattr(self.loader, "position") and os.path.isdir(path):  # an elastic run: the rows of this epoch
            write_position(path, self.rank, *self.loader.position())
        if self.exchange is not None and os.path.isdir(path):
            path = self.exchange.save(path)  # this rank's error-feedback state
        if os.path.isdir(path):  # last: sizes and sha256 of everything this rank saved, checked at resume
            write_manifest(path, self.rank)
        checkpoint = ray.train.Checkpoint.from_directory(path) if os.path.isdir(path) else None
        loss = self._last_loss if self.rank == 0 else None
        with self.exchange.around_report(state.global_step >= state.max_steps) if self.exchange is not None \
                else contextlib.nullcontext():
            ray.train.report({"step": state.global_step, "loss": loss}, checkpoint=checkpoint,
                             checkpoint_dir_name=f"checkpoint-{state.global_step:08d}",
                             delete_local_checkpoint_after_upload=True)
