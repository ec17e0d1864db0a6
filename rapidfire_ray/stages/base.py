"""What every stage's trainer shares: the parts a worker hands it (`WorkerParts`), our
dataloader seam, the step-phase timing, the gradient exchange's seams (hook, optimizer, clip),
and the out-of-memory backoff (at memory level2 first free cached blocks and retry once; then
split the batch, retry, lower the budget)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..data.backoff import BatchDoesNotFit, OOMBackoff, is_out_of_memory, split_batch
from ..memory.allocator import release_cached
from ..telemetry.timing import StepTimer, timed_allreduce_hook


@dataclass
class WorkerParts:
    """What a stage's trainer is built with (`worker/parts.py` makes them from the config)."""
    loader: Any  # batches in the trainer's order (data.loader.ShardLoader, or an elastic run's loader)
    timer: StepTimer = field(default_factory=StepTimer)
    backoff: OOMBackoff = field(default_factory=OOMBackoff)
    exchange: Any = None  # exchange.GradientExchange (None: DDP's own allreduce, timed)
    guard: Any = None  # stages.guard.NanGuard: count skipped steps, stop with a diagnosis
    defragment: bool = False  # memory level2+: on OOM free cached blocks and retry once before splitting
    straggler: Any = None  # faults.Straggler: an injected slowdown (only when its switch is set)
    defrag_retries: int = 0  # counted here, reported in the memory summary


def trainer_args(config_cls, cfg: dict, output_dir: str, use_cpu: bool, **overrides):
    """A TRL trainer's arguments (`SFTConfig`, `RewardConfig`, `GRPOConfig`, ...) from our config:
    the run settings every stage shares, then the stage's own `overrides` (which win)."""
    t, o = cfg["train"], cfg["optimizer"]["params"]
    every = cfg["checkpoint"]["every_steps"]
    args = dict(
        output_dir=output_dir,
        max_steps=t["max_steps"],
        num_train_epochs=t["epochs"],
        per_device_train_batch_size=t["per_device_batch_size"],
        gradient_accumulation_steps=t["gradient_accumulation_steps"],
        max_grad_norm=t["grad_clip"],
        lr_scheduler_type=t["lr_scheduler"],
        warmup_steps=t["warmup_steps"],
        learning_rate=o["lr"],
        weight_decay=o["weight_decay"],
        adam_beta1=o["betas"][0],
        adam_beta2=o["betas"][1],
        adam_epsilon=o["eps"],
        logging_steps=t["log_every_steps"],
        save_strategy="steps",
        save_steps=every if every > 0 else 10**9,  # the callback also saves the last step
        seed=cfg["run"]["seed"],
        use_cpu=use_cpu,
        # TRL defaults to bf16 and gradient checkpointing; precision and memory options are ours
        # (memory/precision.py, memory/checkpointing.py).
        bf16=False,
        fp16=False,
        report_to="none",
        disable_tqdm=True,
        # Rows arrive from our loader, which skips already-trained batches itself.
        ignore_data_skip=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        ddp_bucket_cap_mb=cfg["communication"]["bucket_cap_mb"],
        save_only_model=False,
    )
    args.update(overrides)
    return config_cls(**args)


class _ForwardOutOfMemory(Exception):
    """An out-of-memory error raised in the forward pass (nothing was accumulated or exchanged yet)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class ExchangeSeams:
    """Where the gradient exchange and the NaN guard meet a transformers Trainer (any stage's,
    TRL's online RL trainers too): the optimizer it builds and guards, its clip, its DDP hook.
    Built with `parts=WorkerParts(...)` beside the trainer's own arguments."""

    _rf_hooked = False

    def __init__(self, *args, parts: WorkerParts, **kwargs):
        self.rf = parts
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        exchange = self.rf.exchange
        if self.optimizer is None and exchange is not None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if (n in decay) == with_decay],
                       "param_names": [n for n, _ in named if (n in decay) == with_decay],
                       "weight_decay": self.args.weight_decay if with_decay else 0.0} for with_decay in (True, False)]
            self.optimizer = exchange.build_optimizer([g for g in groups if g["params"]], self.args)
        optimizer = super().create_optimizer(model)
        if exchange is not None:
            exchange.guard(optimizer, self.model)  # skips a non-finite step on every rank alike
            if self.rf.guard is not None:
                self.rf.guard.wrap(optimizer, lambda: self.state.global_step + 1, exchange)
        return optimizer

    def _clip_grad_norm(self, model):
        exchange = self.rf.exchange
        norm = exchange.clip_grad_norm(model, self.args.max_grad_norm) if exchange is not None else None
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _rf_register(self, model) -> None:
        """At the first step, once DDP wraps the model: the exchange's hook (or DDP's, timed)."""
        if not self._rf_hooked and isinstance(model, DistributedDataParallel):
            if self.rf.exchange is not None:
                self.rf.exchange.register(model)
            else:
                model.register_comm_hook(self.rf.timer, timed_allreduce_hook)
            self._rf_hooked = True


class RayStageMixin(ExchangeSeams):
    """Mix into a TRL trainer class (before it in the bases) for the sft and reward stages."""

    rf_rows_per_sample = 1  # batch rows that must stay together when a batch is split (a reward pair: 2)

    def get_train_dataloader(self):
        # TRL rejects Ray iterators as train_dataset, and a HF Dataset would be sharded a second
        # time by the Trainer: the Ray shard reaches the trainer here instead.
        return self.rf.loader

    def compute_loss(self, model, inputs, *args, **kwargs):
        with self.rf.timer.phase("forward"):
            try:
                return super().compute_loss(model, inputs, *args, **kwargs)
            except Exception as e:
                if is_out_of_memory(e):
                    raise _ForwardOutOfMemory(e) from e
                raise

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.rf.guard is not None:
            self.rf.guard.see_batch(inputs)
        self._rf_register(model)
        parts = self.rf.backoff.pieces_for(inputs)
        return self._rf_pieces(model, self._rf_split(inputs, parts) if parts > 1 else [inputs], num_items_in_batch)

    def _rf_split(self, batch: dict, parts: int) -> list[dict]:
        """Split a batch into `parts` pieces trained one after the other (a stage whose samples span
        several rows, such as reward pairs, overrides this)."""
        return split_batch(batch, parts)

    def _rf_pieces(self, model, pieces: list[dict], num_items_in_batch):
        """Forward+backward on each piece, accumulating gradients; only the last piece lets DDP
        exchange them (the others run under `no_sync`), so one batch is one exchange whatever
        the number of pieces. With the loss normalised by the step's token count, the pieces'
        losses and gradients add up to the whole batch's."""
        total = None
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                loss = self._rf_piece(model, piece, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _rf_piece(self, model, piece: dict, num_items_in_batch):
        try:
            return self._rf_timed_step(model, piece, num_items_in_batch)
        except _ForwardOutOfMemory as first:
            error = first
        if self.rf.defragment:
            # Fragmentation can fail a batch that fits: hand cached blocks back and retry it once.
            release_cached(self.args.device)
            self.rf.defrag_retries += 1
            try:
                return self._rf_timed_step(model, piece, num_items_in_batch)
            except _ForwardOutOfMemory as again:
                error = again
        self._rf_split_or_fail(error, piece)
        return self._rf_pieces(model, self._rf_split(piece, 2), num_items_in_batch)

    def _rf_split_or_fail(self, oom: _ForwardOutOfMemory, piece: dict) -> None:
        """Lower this rank's budget for batches like `piece` (the caller retries it in halves), or
        fail with what to change when it is a single row, or under DeepSpeed (whose engine steps
        inside every backward and refuses `no_sync` with ZeRO-3: a batch cannot be split there)."""
        rows, width = piece["input_ids"].shape
        if self.is_deepspeed_enabled:
            raise BatchDoesNotFit(
                f"out of memory on a batch of {rows} x {width} tokens at step {self.state.global_step + 1} under "
                f"ZeRO-3, where a batch cannot be split and retried ({str(oom.error).splitlines()[0][:160]}); lower "
                "train.per_device_batch_size, data.max_length or data.dynamic_batch.memory_threshold") from oom.error
        if rows <= self.rf_rows_per_sample:
            raise BatchDoesNotFit(
                f"out of memory on a single {'row' if rows == 1 else f'sample ({rows} rows)'} of {width} tokens at step {self.state.global_step + 1} "
                f"({str(oom.error).splitlines()[0][:160]}); lower data.max_length, lower "
                "data.dynamic_batch.memory_threshold, raise memory.optim_level or give each worker more memory"
            ) from oom.error
        self.rf.backoff.lower(piece, self.state.global_step + 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand cached blocks back before the smaller retry

    def _rf_timed_step(self, model, inputs, num_items_in_batch):
        timer = self.rf.timer
        start = time.perf_counter()
        # training_step = forward (timed in compute_loss, nested) + backward: backward is what is left.
        with timer.phase("backward"):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.rf.straggler is not None:
                self.rf.straggler.slow_down(start, timer)
        return loss
