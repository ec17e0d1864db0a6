"""What each Ray Train worker of an RL run does: load the policy, take its shard of prompts,
train with GRPO/RLOO (TRL) or PPO (ours) against the reward pool, evaluate on held-out prompts
(rank 0), and hand the final policy to Ray Train as the run's checkpoint."""
from __future__ import annotations

import shutil
import tempfile

import ray
import ray.train
import ray.train.torch
import torch

from ..data.prompts import row_columns
from ..data.sharding import TRAIN
from ..models import load_model, load_tokenizer
from ..models.lora import lora_report, save_final_policy
from ..models.registry import save_pretrained_atomic
from ..telemetry.metrics import WorkerMetrics
from ..config import from_plain
from ..exchange import build_exchange
from ..stages.base import WorkerParts
from ..stages.guard import NanGuard
from ..telemetry.records import WorkerReport
from .evaluate import evaluate
from .reward_pool import RewardPool
from .telemetry import RLStepTimer, TRLStepCallback


def rl_loop_per_worker(config: dict) -> None:
    cfg = from_plain(config["cfg"])  # typed and read-only, as on the sft/reward workers
    rl = cfg.rl
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    use_gpu = cfg.scaling.use_gpu
    torch.set_num_threads(cfg.scaling.cpus_per_worker)
    torch.manual_seed(cfg.run.seed)
    board = config["board"]
    # This worker's metrics on Ray's endpoint (the dashboard's Metrics view), as SFT's workers.
    metrics = WorkerMetrics(cfg.run.name, rank, cfg.train.log_every_steps,
                            threads=cfg.scaling.cpus_per_worker)

    tokenizer = load_tokenizer(cfg.model.name)
    model = load_model(cfg.model.name, dtype=torch.float32)
    pool = RewardPool.from_config(cfg, config["reward_actors"])
    # This rank's prompts, read from its Ray Data shard; every rank keeps the same number so the
    # ranks take the same number of steps.
    shard = ray.train.get_dataset_shard(TRAIN)
    rows = [row_columns(r) for r in shard.iter_rows()][: config["num_rows"] // world]
    scratch = tempfile.mkdtemp(prefix=f"rapidfire-{cfg.run.name}-rl-rank{rank}-")
    timer = RLStepTimer()
    eval_rows = config.get("eval_rows") or []
    try:
        report = WorkerReport(rank=rank)
        if rank == 0 and eval_rows:
            report.eval_before = evaluate(model, tokenizer, eval_rows, pool, rl.max_new_tokens)
        if rl.algorithm in ("grpo", "rloo"):
            from datasets import Dataset

            from .trl_stage import build_trl_trainer, unwrap

            parts = WorkerParts(loader=None, timer=timer, guard=NanGuard.for_run(cfg, model, tokenizer.pad_token_id, rank),
                                exchange=build_exchange(cfg.communication, cfg.optimizer, rank=rank, timer=timer,
                                                        total_steps=_total_steps(cfg, len(rows))))
            callback = TRLStepCallback(board=board, timer=timer, pool=pool, rank=rank, metrics=metrics,
                                       exchange=parts.exchange)
            trainer = build_trl_trainer(cfg, model, tokenizer, Dataset.from_list(rows), pool, callback, scratch,
                                        use_cpu=not use_gpu, parts=parts)
            trainer.train()
            report.skipped_steps = parts.guard.skipped_steps
            policy = unwrap(trainer)
            if cfg.model.lora is not None:  # for the summary's lora section (rank 0's report)
                report.memory = {"lora": lora_report(policy, cfg.model.lora)}
        else:
            from .ppo import train_ppo

            device = ray.train.torch.get_device()
            policy = train_ppo(cfg, model, tokenizer, rows, pool, timer, board, rank, world, device,
                               reward_model=config.get("reward_model"), value_init=config["value_init"],
                               worker_metrics=metrics)
        policy.eval()
        report.reward_pool = dict(pool.total)
        if rank == 0 and eval_rows:
            report.eval_after = evaluate(policy, tokenizer, eval_rows, pool, rl.max_new_tokens)
        ray.get(board.report_worker_end.remote(report))
        checkpoint = None
        if rank == 0:
            if cfg.model.lora is not None:  # merged into the base (a plain model), or the adapter alone
                final = save_final_policy(policy, tokenizer, f"{scratch}/final", cfg.model.lora.export,
                                          cfg.model.name)
            else:
                final = save_pretrained_atomic(policy, tokenizer, f"{scratch}/final")
            checkpoint = ray.train.Checkpoint.from_directory(final)
        ray.train.report({"step": -1}, checkpoint=checkpoint, checkpoint_dir_name="checkpoint-final")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _total_steps(cfg, prompts: int) -> int:
    """The run's optimizer steps (rapidfire_adamw's default warm-up is a share of them): each step
    trains on per_device_batch_size completions, num_generations per prompt."""
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    prompts_per_step = max(1, cfg.train.per_device_batch_size // cfg.rl.num_generations)
    return max(1, int(cfg.train.epochs * prompts // prompts_per_step))
