"""What each Ray Train worker runs: build the model and the stage's TRL trainer, train, report.

The driver (`launcher.py`) passes the resolved config as a plain dict plus run facts (row
count, progress board handle, a sample row for TRL's start-up checks).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time

import ray.train
import ray.train.torch
import torch

from . import elastic
from .config import is_elastic
from .data.backoff import OOMBackoff
from .data.loader import DynamicBatches, ShardLoader
from .data.sharding import PLAN_KEY, TRAIN, ShardPlan
from .checkpoints import usable_checkpoint
from .secrets import redact_std_streams
from .preemption import PreemptionCheck
from .errors import RapidfireError
from .exchange import GradientExchange, build_exchange
from .faults import crash_step, slowdown_for_rank
from .memory import free_memory_bytes, memory_in_use_bytes
from .memory.estimate import MemoryModel
from .memory.setup import WorkerMemory
from .memory.zero import held_bytes
from .models import load_model, load_reward_model, load_tokenizer, model_num_parameters
from .stages.guard import NanGuard
from .stages.reward import build_reward_trainer, reward_args
from .stages.sft import build_sft_trainer, sft_args
from .telemetry.callback import RayRunCallback
from .telemetry.control import KnobClient
from .telemetry.metrics import WorkerMetrics
from .telemetry.rules import CODEC_KNOB
from .telemetry.timing import StepTimer


# train.stage -> (trainer arguments, model from (model.name, tokenizer), trainer): what differs
# between the stages that run on this loop.
STAGES = {
    "sft": (sft_args, lambda name, tokenizer: load_model(name, dtype=torch.float32), build_sft_trainer),
    "reward": (reward_args, lambda name, tokenizer: load_reward_model(name, torch.float32, tokenizer.pad_token_id),
               build_reward_trainer),
}


def train_loop_per_worker(config: dict) -> None:
    redact_std_streams()  # secret env values never reach this worker's logs
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = elastic.adapt(config["cfg"], world)  # an elastic run's batch or learning rate at this worker count
    elastic_run = is_elastic(cfg)
    use_gpu = cfg["scaling"]["use_gpu"]
    torch.set_num_threads(cfg["scaling"]["cpus_per_worker"])
    torch.manual_seed(cfg["run"]["seed"])

    # The newest checkpoint whose files match their manifests (a truncated one is skipped, said once).
    checkpoint = _resume_checkpoint(cfg, config["board"], rank, world)
    attempt = _attempt(config["board"], rank)  # which worker group of the run this is (0: the first)

    device = ray.train.torch.get_device()
    # Measured before the model exists: memory_aware batching budgets against it.
    free_bytes = free_memory_bytes(device, ctx.get_local_world_size())
    baseline_bytes = memory_in_use_bytes(device)
    tokenizer = load_tokenizer(cfg["model"]["name"])
    memory = WorkerMemory.prepare(cfg, device, world, model_num_parameters(cfg["model"]["name"]))
    # Each rank writes its checkpoint pieces to its own local folder; Ray Train merges and stores them.
    local_dir = tempfile.mkdtemp(prefix=f"rapidfire-{cfg['run']['name']}-rank{rank}-")
    # The trainer's arguments come before the model: with ZeRO-3 transformers then builds it partitioned.
    make_args, make_model, make_trainer = STAGES[cfg["train"]["stage"]]
    args = make_args(cfg, local_dir, use_cpu=not use_gpu, precision=memory.precision,
                     deepspeed=memory.deepspeed_config(ctx.get_local_world_size()))
    model = make_model(cfg["model"]["name"], tokenizer)
    memory.adopt(model)
    dynamic = _dynamic_batches(cfg, config["lengths"], memory.batching_model(), rank, world, free_bytes,
                               config["board"])
    # Rank 0's call makes the shards (ExactSplitDataConfig) and publishes their plan; the others wait.
    shard = ray.train.get_dataset_shard(TRAIN)
    plan = ShardPlan.from_json(ray.get(config["board"].get.remote(PLAN_KEY)))
    loader = ShardLoader(shard, num_rows=config["num_rows"], rank=rank,
                         world_size=world, batch_size=cfg["train"]["per_device_batch_size"],
                         pad_id=tokenizer.pad_token_id, prefetch_depth=cfg["data"]["prefetch_depth"],
                         seed=cfg["run"]["seed"], budget=dynamic, rank_rows=[plan.rows(r) for r in range(world)])
    train_loader, resume_info = loader, None
    if elastic_run:  # the rest of the checkpoint's epoch over this worker count, then full epochs
        with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as ckpt_dir:
            train_loader, resume_info = elastic.build_loader(
                cfg, loader, ray.train.get_dataset_shard(elastic.FULL), ckpt_dir, rank=rank, world=world,
                num_rows=config["num_rows"], pad_id=tokenizer.pad_token_id, budget=dynamic)
            start_step = elastic.checkpoint_step(ckpt_dir) if ckpt_dir is not None else 0
        steps = elastic.max_steps(train_loader, start_step, args.gradient_accumulation_steps)
        if steps is not None:
            args.max_steps = steps
        if rank == 0:
            ray.get(config["board"].put.remote(f"elastic/{attempt}", {
                **resume_info, "start_step": start_step, "max_steps": args.max_steps,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "learning_rate": cfg["optimizer"]["params"]["lr"],
                "global_batch_rows": world * cfg["train"]["per_device_batch_size"] * args.gradient_accumulation_steps}))
    if dynamic is not None and dynamic.memory is not None and rank == 0:
        config["board"].put.remote("memory_model", _memory_report(dynamic, loader, baseline_bytes))
    planning_free = dynamic.free_bytes if dynamic is not None and dynamic.memory is not None else free_bytes
    memory.plan_checkpointing(model, _planned_batches(cfg, loader, dynamic),
                              int(planning_free * cfg["data"]["dynamic_batch"]["memory_threshold"]))
    memory.attach(model)
    timer = StepTimer()
    backoff = OOMBackoff()
    backoff.ceiling = cfg["memory"].get("max_forward_tokens")
    exchange = build_exchange(cfg["communication"], cfg["optimizer"], rank=rank, timer=timer,
                              total_steps=args.max_steps if elastic_run and args.max_steps > 0
                              else _total_steps(cfg, len(loader)), shards=config.get("ps_shards"),
                              num_workers=cfg["scaling"]["num_workers"])
    metrics, knobs = _live_telemetry(cfg, config.get("control"), rank, train_loader, backoff, exchange)
    callback = RayRunCallback(board=config["board"], timer=timer, loader=train_loader, rank=rank,
                              stamp={"world": world, "attempt": attempt},
                              every_steps=cfg["checkpoint"]["every_steps"], shard_plan=plan.to_json(),
                              backoff=backoff, exchange=exchange, memory=memory, metrics=metrics, knobs=knobs,
                              memory_limit_bytes=baseline_bytes + free_bytes,
                              preemption=PreemptionCheck(config["board"], rank)
                              if cfg["checkpoint"]["on_preemption"] and exchange.has_process_group else None)
    callbacks = [callback]
    if elastic_run and cfg["scaling"]["elastic"]["batch"] == "scale_lr":
        callbacks.append(elastic.ScaledLR(cfg["optimizer"]["params"]["lr"]))
    trainer = make_trainer(args, model, tokenizer, train_loader, config["sample_rows"], callbacks=callbacks)
    trainer.rf_timer = timer
    trainer.rf_defragment = memory.options.defragment
    trainer.rf_backoff = backoff
    trainer.rf_exchange = exchange
    trainer.rf_guard = NanGuard.for_run(cfg, model, tokenizer.pad_token_id, rank)
    trainer.rf_slowdown = slowdown_for_rank(rank)
    trainer.rf_crash_step = crash_step(cfg["train"]["stage"], rank)

    try:
        if checkpoint is None:
            trainer.train()
        else:
            with checkpoint.as_directory() as ckpt_dir:
                if not elastic_run:  # a fixed-size run skips what it trained of the same shard
                    loader.skip_next(_batches_done_in_epoch(ckpt_dir, len(loader),
                                                            cfg["train"]["gradient_accumulation_steps"]))
                exchange.load(ckpt_dir)
                trainer.train(resume_from_checkpoint=ckpt_dir)
        ps_report = exchange.finish()
        if ps_report is not None:
            ray.get(config["board"].put.remote(f"ps_client/{rank}", {
                **ps_report, "torch_process_group": torch.distributed.is_initialized()}))
        held = {**held_bytes(trainer.model_wrapped, trainer.optimizer), "local_rank": ctx.get_local_rank(),
                "node_id": ray.get_runtime_context().get_node_id()}
        ray.get(config["board"].put.remote(f"held_bytes/{rank}", held))
        if rank == 0:
            ray.get(config["board"].put.remote("guard", {"skipped_steps": trainer.rf_guard.skipped_steps}))
            ray.get(config["board"].put.remote("memory", {**memory.report(), "held_bytes": held,
                                                          "defrag_retries": trainer.rf_defrag_retries}))
    finally:
        memory.detach()
        shutil.rmtree(local_dir, ignore_errors=True)


def _live_telemetry(cfg: dict, control, rank: int, loader: ShardLoader, backoff: OOMBackoff,
                    exchange: GradientExchange):
    """This worker's metrics on Ray's endpoint, and its side of the run's live knobs (`rapidfire monitor`)."""
    every = cfg["train"]["log_every_steps"]
    metrics = WorkerMetrics(cfg["run"]["name"], rank, every, threads=cfg["scaling"]["cpus_per_worker"])
    if control is None:
        return metrics, None

    def set_max_forward_tokens(value):
        backoff.ceiling = value

    appliers = {"data.prefetch_depth": loader.set_prefetch_depth, "memory.max_forward_tokens": set_max_forward_tokens}
    initial = {"data.prefetch_depth": loader.prefetch_depth, "memory.max_forward_tokens": backoff.ceiling}
    if exchange.live_codec() is not None:
        appliers[CODEC_KNOB] = exchange.set_codec
        initial[CODEC_KNOB] = exchange.live_codec()
    knobs = KnobClient(control, rank, every, appliers, initial=initial, on_apply=metrics.knobs)
    metrics.knobs(knobs.values)
    return metrics, knobs


def _resume_checkpoint(cfg: dict, board, rank: int, world: int):
    """The checkpoint this worker group resumes from (None: from the start). With a process group,
    rank 0 chooses (`checkpoints.usable_checkpoint`, preferring a fully saved checkpoint newer than
    the one Ray Train registered) and broadcasts the choice, so every rank loads the same step;
    without one (parameter_server) every rank takes Ray Train's registered checkpoint."""
    registered = ray.train.get_checkpoint()
    say = _checkpoint_note(board, rank)
    if not torch.distributed.is_initialized():
        return usable_checkpoint(registered, say=say)
    choice = [None]
    if rank == 0:
        run_dir = os.path.join(os.path.abspath(cfg["run"]["output_dir"]), cfg["run"]["name"])
        chosen = usable_checkpoint(registered, say=say, run_dir=run_dir, world_size=world,
                                   note=lambda msg: print(f"[rapidfire] {msg}", flush=True))
        choice = [None if chosen is None else chosen.path]
    torch.distributed.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if registered is not None and choice[0] == registered.path:
        return registered
    import pyarrow.fs

    fs = registered.filesystem if registered is not None else pyarrow.fs.LocalFileSystem()
    return ray.train.Checkpoint(choice[0], filesystem=fs)


def _attempt(board, rank: int) -> int | None:
    """How many worker groups of this run started before this one (rank 0 counts them on the
    progress board and tells the others); None without a process group."""
    if not torch.distributed.is_initialized():
        return None
    value = [None]
    if rank == 0:
        value = [(ray.get(board.get.remote("attempts")) or 0)]
        ray.get(board.put.remote("attempts", value[0] + 1))
    torch.distributed.broadcast_object_list(value, src=0)
    return value[0]


def _checkpoint_note(board, rank: int):
    """Rank 0 prints a checkpoint fallback and leaves it on the board for the run summary."""
    def say(msg: str) -> None:
        if rank == 0:
            print(f"[rapidfire] {msg}", flush=True)
            ray.get(board.put.remote("checkpoint_fallback", msg))
    return say


def _dynamic_batches(cfg: dict, lengths, memory: MemoryModel, rank: int, world: int, free_bytes: int,
                     board) -> DynamicBatches | None:
    """The run's dynamic batching; memory_aware plans with the smallest free memory of all ranks,
    so every rank computes the same lockstep plan (through the progress board where there is no
    process group: communication.mode parameter_server)."""
    strategy = cfg["data"]["dynamic_batch"]["strategy"]
    if strategy == "memory_aware" and world > 1:
        if torch.distributed.is_initialized():
            least = torch.tensor([free_bytes], dtype=torch.int64)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
            free_bytes = int(least.item())
        else:
            free_bytes = _least_on_board(board, "free_bytes", free_bytes, rank, world)
    try:
        return DynamicBatches.from_config(cfg, lengths, memory if strategy == "memory_aware" else None, free_bytes)
    except ValueError as e:
        raise RapidfireError(f"data.dynamic_batch: {e}") from None


def _least_on_board(board, key: str, value: int, rank: int, world: int) -> int:
    """The smallest of every rank's `value`, exchanged through the progress board."""
    ray.get(board.put.remote(f"{key}/{rank}", value))
    while True:
        values = ray.get([board.get.remote(f"{key}/{r}") for r in range(world)])
        if all(v is not None for v in values):
            return min(values)
        time.sleep(0.05)


def _planned_batches(cfg: dict, loader: ShardLoader, dynamic: DynamicBatches | None) -> list[tuple[int, int]]:
    """(rows, padded width) of this rank's batches: the dynamic plan's, or for fixed batches the
    batch size at the longest possible row."""
    if dynamic is None:
        return [(cfg["train"]["per_device_batch_size"], cfg["data"]["max_length"])]
    lengths = dynamic.lengths[loader.rank_rows]
    return sorted({(len(b), int(lengths[b].max())) for b in loader.plan})


def _memory_report(dynamic: DynamicBatches, loader: ShardLoader, baseline_bytes: int) -> dict:
    """The memory model's numbers for this rank's most expensive planned batch; the driver puts
    the memory actually used next to them."""
    lengths = dynamic.lengths[loader.rank_rows]
    rows, width = max(((len(b), int(lengths[b].max())) for b in loader.plan),
                      key=lambda rw: dynamic.memory.batch_bytes(*rw))
    return {"free_bytes": dynamic.free_bytes, "budget_bytes": dynamic.budget_bytes,
            "static_bytes": dynamic.memory.static_bytes(), "largest_batch": {"rows": rows, "width": width},
            "estimated_peak_bytes": dynamic.memory.peak_bytes(rows, width), "baseline_bytes": baseline_bytes,
            "description": dynamic.description}


def _total_steps(cfg: dict, batches_per_epoch: int) -> int:
    """Optimizer steps the run will take (what transformers computes from max_steps or epochs)."""
    t = cfg["train"]
    if t["max_steps"] > 0:
        return t["max_steps"]
    return max(1, int(math.ceil(t["epochs"] * max(1, batches_per_epoch // t["gradient_accumulation_steps"]))))


def _batches_done_in_epoch(ckpt_dir: str, batches_per_epoch: int, grad_accum: int) -> int:
    """Micro-batches of the current epoch already trained on at the checkpoint's step."""
    with open(os.path.join(ckpt_dir, "trainer_state.json"), encoding="utf-8") as f:
        step = json.load(f)["global_step"]
    updates_per_epoch = max(1, -(-batches_per_epoch // grad_accum))
    return (step % updates_per_epoch) * grad_accum
