"""The trainer callback that connects a TRL/transformers trainer to Ray and to our telemetry:
step records to the progress board, checkpoints to Ray Train, saves on schedule."""
from __future__ import annotations

import contextlib
import os
import time

import ray.train
from transformers import TrainerCallback

from ..atomic import atomic_write_json
from ..checkpoints import SHARD_PLAN_FILE, write_manifest
from ..data.elastic import write_position
from .timing import StepTimer, peak_memory_bytes



class OptimizerClock(TrainerCallback):
    """Times the optimizer step into `self.timer`'s `optimizer` phase."""

    _opt_start = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._opt_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._opt_start is not None:
            self.timer.add("optimizer", time.perf_counter() - self._opt_start)
            self._opt_start = None


class RayRunCallback(OptimizerClock):
    def __init__(self, *, board, timer: StepTimer, loader, rank: int, every_steps: int, shard_plan: dict | None = None,
                 backoff=None, exchange=None, memory=None, metrics=None, knobs=None, memory_limit_bytes=None,
                 preemption=None, stamp: dict | None = None):
        self.board = board
        self.timer = timer
        self.loader = loader
        self.rank = rank
        self.every_steps = every_steps
        self.shard_plan = shard_plan  # saved with every checkpoint: a resume reads the same shards
        self.backoff = backoff  # the step's out-of-memory splits (data.backoff.OOMBackoff)
        self._oom_seen = 0
        self.exchange = exchange  # exchange.GradientExchange: bytes, latency, compression, skipped steps
        self.memory = memory  # memory.setup.WorkerMemory: saved-activation bytes per step
        self._counts = (0, 0, 0)
        self._last_loss = None
        self.metrics = metrics  # telemetry.metrics.WorkerMetrics: Ray's metrics endpoint
        self.knobs = knobs  # telemetry.control.KnobClient: live knob changes, applied at step boundaries
        self.memory_limit_bytes = memory_limit_bytes
        self.preemption = preemption  # preemption.PreemptionCheck: a node's preemption notice -> checkpoint
        self.stamp = stamp or {}  # put on every step record: the worker count and worker group (attempt)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.exchange is not None:
            self.exchange.begin()
        self.timer.take()  # start the first step's clock here, after model and optimizer set-up
        self.loader.wait_s = 0.0
        self._counts = self._loader_counts()
        if self.rank == 0:
            self.board.set_plan.remote(state.max_steps, state.global_step)
        if self.knobs is not None:
            self.knobs.begin(state.global_step, self.memory_limit_bytes)

    def _loader_counts(self) -> tuple[int, int, int]:
        loader = self.loader
        return loader.rows_yielded, loader.tokens_yielded, loader.padded_tokens_yielded

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.add("data_wait", self.loader.wait_s)
        self.loader.wait_s = 0.0
        phases = self.timer.take()
        comm = self.exchange.take_stats() if self.exchange is not None else {}
        where = comm.pop("untimed_comm_phase", None)
        if where is not None:  # exchange time the step timer could not see: move it to communication
            moved = min(comm["comm_seconds"], phases[where])
            phases[where] -= moved
            phases["communication"] += moved
        counts = self._loader_counts()
        samples, tokens, padded = (now - before for now, before in zip(counts, self._counts))
        self._counts = counts
        record = {
            "rank": self.rank, "step": state.global_step, "time": time.time(), "pid": os.getpid(), **self.stamp,
            "phases": phases,
            "samples": samples, "tokens": tokens, "padded_tokens": padded, "peak_memory_bytes": peak_memory_bytes(),
            "oom_splits": self._new_oom_splits(), **comm,
            **(self.memory.take_step() if self.memory is not None else {}),
            **({"knobs": dict(self.knobs.values)} if self.knobs is not None else {}),
        }
        self.board.push_step.remote(record)
        if self.metrics is not None:
            self.metrics.step(record)
        if self.knobs is not None:
            self.knobs.step_end(state.global_step)  # changes due after this step apply to the next one
        # Save on schedule and always at the last step (transformers only saves on the schedule).
        if state.global_step >= state.max_steps or (self.every_steps and state.global_step % self.every_steps == 0):
            control.should_save = True
        if getattr(self.loader, "finished", False):  # an elastic run's stream handed out its last epoch
            control.should_save = control.should_training_stop = True
        if self.preemption is not None and state.global_step < state.max_steps:
            self.preemption.step_end(state.global_step, control)
        if control.should_save and self.exchange is not None:
            self.exchange.before_save()
        return control

    def _new_oom_splits(self) -> int:
        if self.backoff is None:
            return 0
        new = len(self.backoff.events) - self._oom_seen
        self._oom_seen = len(self.backoff.events)
        return new

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.metrics is not None and logs:
            self.metrics.log(logs)
        if self.rank == 0 and logs and "loss" in logs:
            self._last_loss = float(logs["loss"])
            self.board.push_log.remote({"step": state.global_step, "loss": self._last_loss,
                                        "learning_rate": logs.get("learning_rate"),
                                        "grad_norm": logs.get("grad_norm"),
                                        # the reward stage's training pairs (TRL's RewardTrainer logs them)
                                        **{k: float(logs[k]) for k in ("accuracy", "margin") if k in logs}})

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
        with self.exchange.around_report(state.global_step >= state.max_steps) if self.exchange is not None \
                else contextlib.nullcontext():
            ray.train.report({"step": state.global_step, "loss": self._last_loss}, checkpoint=checkpoint,
                             checkpoint_dir_name=f"checkpoint-{state.global_step:08d}",
                             delete_local_checkpoint_after_upload=True)
