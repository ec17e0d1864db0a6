"""One worker's parts, each built from its part of the config: the stage's trainer pieces, the
data loader (with dynamic batches), the memory plan, the gradient exchange, and the trainer
callbacks. `worker/loop.py` puts them together."""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import ray
import ray.train
import torch
from transformers import TrainerCallback

from ..checkpoints.saver import CheckpointSaver
from ..data.loader import DynamicBatches, ShardLoader
from ..data.sharding import TRAIN, ShardPlan
from ..errors import RapidfireError
from ..faults import CRASH, InjectedCrash, crash_step
from ..memory.estimate import MemoryModel
from ..memory.setup import WorkerMemory
from ..models import load_model, load_reward_model
from ..models.lora import CAUSAL_LM, SEQ_CLS
from ..preemption import PreemptionCheck
from ..stages.reward import build_reward_trainer, reward_args
from ..stages.sft import build_sft_trainer, sft_args
from ..telemetry.control import KnobClient
from ..telemetry.live_knobs import LiveKnobs
from ..telemetry.metrics import WorkerMetrics
from ..telemetry.recorder import StepRecorder
from ..telemetry.rules import CODEC_KNOB
from . import elastic


@dataclass(frozen=True)
class WorkerStage:
    """What differs between the stages that run on this loop."""
    make_args: Callable  # (cfg, output_dir, use_cpu, precision, deepspeed) -> the TRL trainer's arguments
    make_model: Callable  # (model name, tokenizer) -> the model
    make_trainer: Callable  # (args, model, tokenizer, parts, sample_rows, callbacks) -> the trainer
    lora_task: str  # the PEFT task type of its model's adapters (model.lora)


STAGES = {
    "sft": WorkerStage(sft_args, lambda name, tokenizer: load_model(name, dtype=torch.float32), build_sft_trainer,
                       CAUSAL_LM),
    "reward": WorkerStage(reward_args,
                          lambda name, tokenizer: load_reward_model(name, torch.float32, tokenizer.pad_token_id),
                          build_reward_trainer, SEQ_CLS),
}


@dataclass
class WorkerData:
    loader: ShardLoader  # this rank's exact shard
    train_loader: Any  # what the trainer iterates (an elastic run: the checkpoint epoch's rest, then full epochs)
    dynamic: DynamicBatches | None
    plan: ShardPlan  # the run's shard plan (saved with every checkpoint)


# --- data --------------------------------------------------------------------------------------

def build_dynamic_batches(cfg, lengths, memory: MemoryModel, run, free_bytes: int) -> DynamicBatches | None:
    """The run's dynamic batching; memory_aware plans with the smallest free memory of all ranks,
    so every rank computes the same lockstep plan (through the run board where there is no
    process group: communication.mode parameter_server)."""
    strategy = cfg.data.dynamic_batch.strategy
    if strategy == "memory_aware" and run.world > 1:
        if torch.distributed.is_initialized():
            least = torch.tensor([free_bytes], dtype=torch.int64)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
            free_bytes = int(least.item())
        else:
            free_bytes = ray.get(run.board.gather_min.remote("free_bytes", run.rank, run.world, free_bytes))
    try:
        return DynamicBatches.from_config(cfg, lengths, memory if strategy == "memory_aware" else None, free_bytes)
    except ValueError as e:
        raise RapidfireError(f"data.dynamic_batch: {e}") from None


def build_data(cfg, run, args, tokenizer, dynamic: DynamicBatches | None) -> WorkerData:
    """This rank's loader over its Ray Data shard; an elastic run's loader (and its step count in
    `args.max_steps`) from the checkpoint's position at this worker count."""
    # Rank 0's call makes the shards (ExactSplitDataConfig) and publishes their plan; the others wait.
    shard = ray.train.get_dataset_shard(TRAIN)
    plan = ShardPlan.from_json(ray.get(run.board.shard_plan.remote()))
    loader = ShardLoader(shard, num_rows=run.num_rows, rank=run.rank, world_size=run.world,
                         batch_size=cfg.train.per_device_batch_size, pad_id=tokenizer.pad_token_id,
                         prefetch_depth=cfg.data.prefetch_depth, seed=cfg.run.seed, budget=dynamic,
                         rank_rows=[plan.rows(r) for r in range(run.world)])
    if not run.elastic:
        return WorkerData(loader, loader, dynamic, plan)
    checkpoint = run.checkpoint
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as ckpt_dir:
        train_loader, resume_info = elastic.build_loader(
            cfg, loader, ray.train.get_dataset_shard(elastic.FULL), ckpt_dir, rank=run.rank, world=run.world,
            num_rows=run.num_rows, pad_id=tokenizer.pad_token_id, budget=dynamic)
        start_step = elastic.checkpoint_step(ckpt_dir) if ckpt_dir is not None else 0
    steps = elastic.max_steps(train_loader, start_step, args.gradient_accumulation_steps)
    if steps is not None:
        args.max_steps = steps
    if run.rank == 0:
        ray.get(run.board.report_elastic_start.remote(run.attempt, {
            **resume_info, "start_step": start_step, "max_steps": args.max_steps,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "learning_rate": cfg.optimizer.params.lr,
            "global_batch_rows": run.world * cfg.train.per_device_batch_size * args.gradient_accumulation_steps}))
    return WorkerData(loader, train_loader, dynamic, plan)


def total_steps(cfg, args, batches_per_epoch: int, elastic_run: bool) -> int:
    """Optimizer steps the run will take (what transformers computes from max_steps or epochs)."""
    if elastic_run and args.max_steps > 0:
        return args.max_steps
    t = cfg.train
    if t.max_steps > 0:
        return t.max_steps
    return max(1, int(math.ceil(t.epochs * max(1, batches_per_epoch // t.gradient_accumulation_steps))))


# --- memory ------------------------------------------------------------------------------------

def fit_memory(cfg, memory: WorkerMemory, model, data: WorkerData, free_bytes: int) -> None:
    """Checkpoint as many blocks as this rank's largest planned batch needs, then start counting
    (and compressing) saved activations."""
    dynamic = data.dynamic
    planning_free = dynamic.free_bytes if dynamic is not None and dynamic.memory is not None else free_bytes
    memory.plan_checkpointing(model, planned_batches(cfg, data),
                              int(planning_free * cfg.data.dynamic_batch.memory_threshold))
    memory.attach(model)


def planned_batches(cfg, data: WorkerData) -> list[tuple[int, int]]:
    """(rows, padded width) of this rank's batches: the dynamic plan's, or for fixed batches the
    batch size at the longest possible row."""
    if data.dynamic is None:
        return [(cfg.train.per_device_batch_size, cfg.data.max_length)]
    lengths = data.dynamic.lengths[data.loader.rank_rows]
    return sorted({(len(b), int(lengths[b].max())) for b in data.loader.plan})


def memory_model_report(data: WorkerData, baseline_bytes: int) -> dict:
    """memory_aware's numbers for this rank's most expensive planned batch; the driver puts the
    memory actually used next to them."""
    dynamic, loader = data.dynamic, data.loader
    lengths = dynamic.lengths[loader.rank_rows]
    rows, width = max(((len(b), int(lengths[b].max())) for b in loader.plan),
                      key=lambda rw: dynamic.memory.batch_bytes(*rw))
    return {"free_bytes": dynamic.free_bytes, "budget_bytes": dynamic.budget_bytes,
            "static_bytes": dynamic.memory.static_bytes(), "largest_batch": {"rows": rows, "width": width},
            "estimated_peak_bytes": dynamic.memory.peak_bytes(rows, width), "baseline_bytes": baseline_bytes,
            "description": dynamic.description}


# --- callbacks ---------------------------------------------------------------------------------

def build_callbacks(cfg, run, parts, memory: WorkerMemory, data: WorkerData, control,
                    memory_limit_bytes: int) -> list:
    """The trainer's callbacks, one job each, in the order they must act at a step's end: a
    preemption notice asks for a save, the saver decides and saves, the recorder measures, the
    live knobs change what the next step runs with. Fault injection only when switched on."""
    metrics = WorkerMetrics(cfg.run.name, run.rank, cfg.train.log_every_steps, threads=cfg.scaling.cpus_per_worker)
    knobs = live_knobs(cfg, control, run.rank, data.train_loader, parts, metrics)
    callbacks = []
    if cfg.checkpoint.on_preemption and parts.exchange.has_process_group:
        callbacks.append(PreemptionCheck(run.board, run.rank))
    callbacks += [
        CheckpointSaver(rank=run.rank, every_steps=cfg.checkpoint.every_steps, loader=data.train_loader,
                        exchange=parts.exchange, shard_plan=data.plan.to_json()),
        StepRecorder(board=run.board, timer=parts.timer, loader=data.train_loader, rank=run.rank, world=run.world,
                     attempt=run.attempt, backoff=parts.backoff, exchange=parts.exchange, memory=memory,
                     metrics=metrics, knobs=knobs),
    ]
    if knobs is not None:
        callbacks.append(LiveKnobs(knobs, memory_limit_bytes))
    if run.elastic and cfg.scaling.elastic.batch == "scale_lr":
        callbacks.append(elastic.ScaledLR(cfg.optimizer.params.lr))
    crash = CrashAt.for_worker(cfg.train.stage, run.rank)
    if crash is not None:
        callbacks.append(crash)
    return callbacks


def live_knobs(cfg, control, rank: int, loader, parts, metrics: WorkerMetrics) -> KnobClient | None:
    """This worker's side of the run's live knobs (`rapidfire monitor`); None without a control actor."""
    if control is None:
        return None
    backoff, exchange = parts.backoff, parts.exchange

    def set_max_forward_tokens(value):
        backoff.ceiling = value

    appliers = {"data.prefetch_depth": loader.set_prefetch_depth, "memory.max_forward_tokens": set_max_forward_tokens}
    initial = {"data.prefetch_depth": loader.prefetch_depth, "memory.max_forward_tokens": backoff.ceiling}
    if exchange.live_codec() is not None:
        appliers[CODEC_KNOB] = exchange.set_codec
        initial[CODEC_KNOB] = exchange.live_codec()
    knobs = KnobClient(control, rank, cfg.train.log_every_steps, appliers, initial=initial, on_apply=metrics.knobs)
    metrics.knobs(knobs.values)
    return knobs


class CrashAt(TrainerCallback):
    """Raises `InjectedCrash` when optimizer step `step` starts."""

    def __init__(self, step: int):
        self.step = step

    @classmethod
    def for_worker(cls, stage: str, rank: int, environ=os.environ) -> CrashAt | None:
        step = crash_step(stage, rank, environ)
        return cls(step) if step is not None else None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise InjectedCrash(f"injected crash at step {self.step} ({CRASH})")
