"""What each Ray Train worker of the sft and reward stages runs: assemble its parts, train, report.

The driver (`driver/run.py`) hands every worker the resolved config as a plain dict (typed again
here) and the run's facts: row count, the run board, sample rows for TRL's start-up checks,
row lengths for dynamic batching, the control actor and the parameter-server shards.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch
import torch
from omegaconf import DictConfig

from ..config import from_plain, is_elastic
from ..errors import RapidfireError
from ..exchange import build_exchange
from ..faults import Straggler
from ..log import quiet_libraries
from ..memory import free_memory_bytes, memory_in_use_bytes
from ..memory.setup import WorkerMemory
from ..memory.zero import held_bytes
from ..models import load_tokenizer, model_num_parameters
from ..models.lora import apply_lora, lora_report
from ..secrets import redact_std_streams
from ..stages.base import WorkerParts
from ..stages.guard import NanGuard
from ..telemetry.records import WorkerReport
from . import elastic
from .parts import (STAGES, build_callbacks, build_data, build_dynamic_batches, fit_memory, memory_model_report,
                    total_steps)
from .resume import batches_done_in_epoch, resume_checkpoint, start_attempt


@dataclass
class WorkerRun:
    """This worker's place in the run."""
    cfg: DictConfig  # typed and read-only; an elastic run's batch or learning rate at this worker count
    rank: int
    world: int
    device: torch.device
    board: Any  # telemetry.board.RunBoard
    num_rows: int
    attempt: int | None  # which worker group of the run (0: the first; None without a process group)
    checkpoint: Any  # the ray.train.Checkpoint this group resumes from (None: the start)

    @property
    def elastic(self) -> bool:
        return is_elastic(self.cfg)


def check_zero_precision(ckpt_dir: str, bf16: bool) -> None:
    """DeepSpeed names a ZeRO-3 checkpoint's optimizer partitions by precision (bf16_zero_pp_rank_*
    under bf16): a resume computing another precision would stop on a missing file. One line
    naming train.precision instead."""
    import glob

    optim = [os.path.basename(f) for f in glob.glob(os.path.join(ckpt_dir, "global_step*", "*optim_states.pt"))]
    if not optim:
        return  # not a ZeRO checkpoint
    saved_bf16 = all(name.startswith("bf16_") for name in optim)
    if saved_bf16 != bf16:
        saved, now = ("bf16", "fp32 or fp16") if saved_bf16 else ("fp32 or fp16", "bf16")
        raise RapidfireError(f"train.precision: checkpoint {os.path.basename(os.path.normpath(ckpt_dir))} holds ZeRO-3 "
                             f"optimizer partitions saved under {saved} ({optim[0]}), this run computes {now}; "
                             f"resume with the train.precision it was trained with (the run summary's "
                             f"memory.precision)")


def train_loop_per_worker(config: dict) -> None:
    redact_std_streams()  # secret env values never reach this worker's logs
    quiet_libraries()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = from_plain(elastic.adapt(config["cfg"], world))
    torch.set_num_threads(cfg.scaling.cpus_per_worker)
    torch.manual_seed(cfg.run.seed)
    board = config["board"]
    run_dir = os.path.join(os.path.abspath(cfg.run.output_dir), cfg.run.name)
    # The newest checkpoint whose files match their manifests (a truncated one is skipped, said once).
    checkpoint = resume_checkpoint(run_dir, board, rank, world)
    run = WorkerRun(cfg, rank, world, ray.train.torch.get_device(), board, config["num_rows"],
                    start_attempt(board, rank), checkpoint)
    # Each rank writes its checkpoint pieces to its own local folder; Ray Train merges and stores them.
    local_dir = tempfile.mkdtemp(prefix=f"rapidfire-{cfg.run.name}-rank{rank}-")
    memory = None
    try:
        trainer, parts, memory, data = assemble(run, config, local_dir, ctx.get_local_world_size())
        if checkpoint is None:
            trainer.train()
        else:
            with checkpoint.as_directory() as ckpt_dir:
                if not run.elastic:  # a fixed-size run skips what it trained of the same shard
                    data.loader.skip_next(batches_done_in_epoch(ckpt_dir, len(data.loader),
                                                                cfg.train.gradient_accumulation_steps))
                parts.exchange.load(ckpt_dir)
                check_zero_precision(ckpt_dir, memory.precision.trainer_flags()["bf16"])
                trainer.train(resume_from_checkpoint=ckpt_dir)
        report_end(run, trainer, parts, memory, ctx.get_local_rank())
    finally:
        if memory is not None:
            memory.detach()
        shutil.rmtree(local_dir, ignore_errors=True)


def assemble(run: WorkerRun, config: dict, local_dir: str, local_world: int):
    """The stage's trainer with this worker's parts: (trainer, parts, memory, data)."""
    cfg, stage = run.cfg, STAGES[run.cfg.train.stage]
    # Measured before the model exists: memory_aware batching budgets against it.
    free_bytes = free_memory_bytes(run.device, local_world)
    baseline_bytes = memory_in_use_bytes(run.device)
    tokenizer = load_tokenizer(cfg.model.name)
    memory = WorkerMemory.prepare(cfg, run.device, run.world, model_num_parameters(cfg.model.name))
    # The trainer's arguments come before the model: with ZeRO-3 transformers then builds it partitioned.
    args = stage.make_args(cfg, local_dir, use_cpu=not cfg.scaling.use_gpu, precision=memory.precision,
                           deepspeed=memory.deepspeed_config(local_world))
    model = stage.make_model(cfg.model.name, tokenizer)
    if cfg.model.lora is not None:  # the base frozen: the exchange, optimizer and memory model see the adapters only
        model = apply_lora(model, cfg.model.lora, stage.lora_task, cfg.model.name)
    memory.adopt(model)
    dynamic = build_dynamic_batches(cfg, config["lengths"], memory.batching_model(), run, free_bytes)
    data = build_data(cfg, run, args, tokenizer, dynamic)
    if dynamic is not None and dynamic.memory is not None and run.rank == 0:
        run.board.report_memory_model.remote(memory_model_report(data, baseline_bytes))
    fit_memory(cfg, memory, model, data, free_bytes)
    parts = WorkerParts(loader=data.train_loader, defragment=memory.options.defragment,
                        guard=NanGuard.for_run(cfg, model, tokenizer.pad_token_id, run.rank),
                        straggler=Straggler.for_rank(run.rank))
    parts.backoff.ceiling = cfg.memory.max_forward_tokens
    parts.exchange = build_exchange(cfg.communication, cfg.optimizer, rank=run.rank, timer=parts.timer,
                                    total_steps=total_steps(cfg, args, len(data.loader), run.elastic),
                                    shards=config.get("ps_shards"), num_workers=cfg.scaling.num_workers)
    callbacks = build_callbacks(cfg, run, parts, memory, data, config.get("control"),
                                memory_limit_bytes=baseline_bytes + free_bytes)
    trainer = stage.make_trainer(args, model, tokenizer, parts, config["sample_rows"], callbacks=callbacks)
    return trainer, parts, memory, data


def report_end(run: WorkerRun, trainer, parts: WorkerParts, memory: WorkerMemory, local_rank: int) -> None:
    """This rank trained its last step: what it held, what its exchange and guard counted (rank 0:
    the memory levels' report), for the run summary."""
    exchange_report = parts.exchange.finish()
    if exchange_report is not None:
        exchange_report = {**exchange_report, "torch_process_group": torch.distributed.is_initialized()}
    held = {**held_bytes(trainer.model_wrapped, trainer.optimizer), "local_rank": local_rank,
            "node_id": ray.get_runtime_context().get_node_id()}
    ray.get(run.board.report_worker_end.remote(WorkerReport(
        rank=run.rank, held_bytes=held, exchange=exchange_report, skipped_steps=parts.guard.skipped_steps,
        memory={**memory.report(), "held_bytes": held, "defrag_retries": parts.defrag_retries,
                "lora": lora_report(trainer.model, run.cfg.model.lora) if run.cfg.model.lora is not None else None}
        if run.rank == 0 else None)))
