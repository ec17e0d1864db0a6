"""The memory layer applied to one training worker: precision, checkpointing plan, int8 saved
activations, allocator, and what the run summary reports about them.

Order inside a worker (`worker.py`):
1. `WorkerMemory.prepare(cfg, device, world, num_params)`, before the model exists: the level's
   options and the precision; with ZeRO-3 DeepSpeed is set up first, and `deepspeed_config()`
   goes into the trainer's arguments, which are built before the model so that transformers
   builds the model partitioned;
   `adopt(model)`: fp8 swaps the decoder's linear layers; the memory model the dynamic batcher
   plans with: at level1 and up, batches are planned as if every block were checkpointed (the
   most the budget can hold), then
2. `plan_checkpointing(batches, free_bytes)` checkpoints only as many blocks as this rank's
   largest planned batch needs (`memory/checkpointing.py`), and
3. `attach()` starts counting saved activations (and compressing them to int8 inside the decoder
   blocks when the level or `optimizer.params.compression.act` says so).
Saved-activation bytes are counted on sampled steps only (the first, then every
`train.log_every_steps`): counting runs a Python hook per saved tensor, a cost a GPU step must not
pay every time. A sampled step's bytes go into its step record (`take_step`); `report()` (the
summary's `memory` section) has the largest of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import allocator, zero
from .activations import ActivationStats, Int8Activations, SavedBytesCounter
from .checkpointing import CheckpointPlan, apply_checkpointing, plan_for_batches
from .estimate import MemoryModel
from .levels import MemoryOptions
from .precision import Hardware, Precision, choose, convert_to_fp8


@dataclass
class WorkerMemory:
    options: MemoryOptions
    precision: Precision
    device: torch.device
    world: int
    model_memory: MemoryModel | None = None  # (after adopt) no checkpointing: what the checkpoint plan starts from
    checkpoint: CheckpointPlan | None = None
    fp8_layers: int = 0
    stats: ActivationStats = field(default_factory=ActivationStats)
    _handles: list = field(default_factory=list)
    sample_every: int = 1  # count saved activations on the first step and every sample_every-th
    _steps: list = field(default_factory=list)  # (raw, stored) saved-activation bytes of each sampled step
    _counting: bool = True

    @classmethod
    def prepare(cls, cfg: dict, device: torch.device, world: int, num_params: int) -> WorkerMemory:
        """Before the model is built: the level's options and the precision (from the parameter
        count of the model's config); with ZeRO-3, DeepSpeed set up so that the model is built
        partitioned."""
        options = MemoryOptions.from_config(cfg)
        precision = choose(cfg["train"]["precision"], num_params, Hardware.detect(device))
        if options.zero_stage:
            zero.prepare_process(use_gpu=device.type == "cuda")
        return cls(options=options, precision=precision, device=device, world=world,
                   sample_every=max(1, int(cfg["train"]["log_every_steps"])))

    def deepspeed_config(self, local_world_size: int) -> dict | None:
        if not self.options.zero_stage:
            return None
        if self.options.hybrid:
            local_world_size = zero.hybrid_group_size()
        return zero.deepspeed_config(self.options, local_world_size=local_world_size,
                                     use_gpu=self.device.type == "cuda")

    def adopt(self, model: torch.nn.Module) -> None:
        """After the model is built: fp8 layers, and the memory model of this run."""
        self.fp8_layers = convert_to_fp8(model) if self.precision.compute == "fp8" else 0
        self.model_memory = MemoryModel.for_model(model, world_size=self.world, act_bytes=self.precision.activation_bytes,
                                                  int8_layers=self.options.act == "int8",
                                                  zero_shards=self.world if self.options.zero_stage else 1)

    def batching_model(self) -> MemoryModel:
        """The memory model memory_aware batching plans with: at level1+ every block may be
        checkpointed, so batches may be as large as that allows (the plan then checkpoints only
        as many blocks as the batches need)."""
        if self.options.checkpointing:
            return replace(self.model_memory, checkpointed_layers=self.model_memory.num_layers)
        return self.model_memory

    def plan_checkpointing(self, model: torch.nn.Module, batches: list[tuple[int, int]], budget_bytes: int) -> None:
        """Checkpoint as few decoder blocks as this rank's batches (rows, padded width) need to fit
        in `budget_bytes`."""
        if not self.options.checkpointing or not batches:
            return
        self.checkpoint = plan_for_batches(self.model_memory, budget_bytes, batches)
        apply_checkpointing(model, self.checkpoint.indices)

    def attach(self, model: torch.nn.Module) -> None:
        """Count what autograd saves (whole model; under ZeRO-3 the decoder blocks only, see
        SavedBytesCounter), compressing inside the decoder blocks at int8."""
        self._handles.append(SavedBytesCounter(self.stats, layers_only=bool(self.options.zero_stage)).attach(model))
        if self.options.act == "int8":
            self._handles.append(Int8Activations(stats=self.stats).attach(model))
        self._count(True)

    def _count(self, on: bool) -> None:
        """Count the next step's saved activations or not: the counter's hooks are left out of the
        forward entirely, and the int8 hooks compress without counting."""
        self._counting = on
        for handle in self._handles:
            handle.count(self.stats if on else None)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take_step(self, step: int) -> dict:
        """At the end of optimizer step `step`: its saved-activation bytes (raw: without compression;
        stored: held) if it was a sampled step, else nothing; then whether step + 1 is sampled."""
        out = {}
        if self._counting:
            raw, stored = self.stats.raw_bytes, self.stats.stored_bytes
            self.stats.reset()
            self._steps.append((raw, stored))
            out = {"saved_activation_bytes": stored, "saved_activation_raw_bytes": raw}
        self._count((step + 1) % self.sample_every == 0)
        return out

    def describe(self) -> str:
        parts = [self.options.describe(), self.precision.describe()]
        if self.checkpoint is not None:
            parts.append(self.checkpoint.describe())
        if self.options.defragment:
            parts.append(allocator.describe(self.device))
        if self.fp8_layers:
            parts.append(f"{self.fp8_layers} linear layers in fp8")
        return "; ".join(parts)

    def report(self) -> dict:
        steps = self._steps or [(0, 0)]
        raw, stored = max(r for r, _ in steps), max(s for _, s in steps)
        return {
            "level": self.options.level, "options": self.options.to_dict(), "precision": self.precision.to_dict(),
            "checkpointed_layers": list(self.checkpoint.indices) if self.checkpoint else [],
            "checkpoint_plan": self.checkpoint.describe() if self.checkpoint else None,
            "fp8_layers": self.fp8_layers,
            "saved_activation_bytes": stored, "saved_activation_raw_bytes": raw,
            "saved_activation_ratio": round(stored / raw, 4) if raw else None,
            "description": self.describe(),
        }

