"""Elastic runs (`scaling.num_workers: [min, max]`) on the worker side: the global batch at the
current worker count, the learning rate that goes with it, and where the data stream resumes.

Ray Train's elastic scaling starts the run once `min` workers fit, and restarts the worker group
with more (nodes joined) or fewer (a node lost) workers, up to `max`, from the latest checkpoint.
Each worker group calls `adapt` before building its trainer:

- `scaling.elastic.batch: accumulate` keeps the global batch of `max` workers: gradient
  accumulation x max / workers, rounded to a whole number of micro-batches (exact when the
  worker count divides max x accumulation; the summary records every worker count's batch);
- `scale_lr`: the learning rate x workers / max (the linear scaling rule), set again after a
  resume restores the optimizer and scheduler (`ScaledLR`);
- `none`: nothing changes.

The data stream (`data.elastic.ElasticLoader`) resumes from the checkpoint's position files.
"""
from __future__ import annotations

import copy
import json
import os

from transformers import TrainerCallback

from ..config import is_elastic, worker_range
from ..data.elastic import ElasticLoader, RowSubset, optimizer_steps, read_position, remainder_shares
from ..data.loader import ShardLoader
from ..errors import RapidfireError
from ..data.sharding import FULL  # noqa: F401 - the whole training dataset, for the rest of an epoch


def adapt(cfg: dict, world: int) -> dict:
    """`cfg` (a plain dict) for a worker group of `world` workers: a copy with the accumulation or
    learning rate the elastic batch policy gives; unchanged for a fixed-size run."""
    if not is_elastic(cfg):
        return cfg
    hi = worker_range(cfg)[1]
    policy = cfg["scaling"]["elastic"]["batch"]
    out = copy.deepcopy(cfg)
    if policy == "accumulate":
        out["train"]["gradient_accumulation_steps"] = accumulation(cfg["train"]["gradient_accumulation_steps"],
                                                                   hi, world)
    elif policy == "scale_lr":
        out["optimizer"]["params"]["lr"] = cfg["optimizer"]["params"]["lr"] * world / hi
    return out


def accumulation(base: int, max_workers: int, world: int) -> int:
    """Micro-batches per optimizer step keeping `max_workers` x `base` micro-batches per step."""
    return max(1, round(base * max_workers / world))


class ScaledLR(TrainerCallback):
    """Puts the learning rate of this worker count back after a resume: loading the optimizer's
    and scheduler's state brings back the learning rate of the worker count that saved them."""

    def __init__(self, lr: float):
        self.lr = lr

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if optimizer is None:
            return
        groups = optimizer.param_groups
        if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
            lr_scheduler.base_lrs = [self.lr for _ in groups]
            lambdas = getattr(lr_scheduler, "lr_lambdas", None)  # transformers' schedules are LambdaLR
            lrs = ([self.lr * f(lr_scheduler.last_epoch) for f in lambdas] if lambdas is not None
                   else lr_scheduler.base_lrs)
        else:
            lrs = [self.lr for _ in groups]
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
            group["initial_lr"] = self.lr


def checkpoint_step(ckpt_dir: str) -> int:
    with open(os.path.join(ckpt_dir, "trainer_state.json"), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


def build_loader(cfg: dict, full: ShardLoader, whole, ckpt_dir: str | None, *, rank: int, world: int,
                 num_rows: int, pad_id: int, budget) -> tuple[ElasticLoader, dict]:
    """The worker's stream: from the checkpoint's position (the rest of its epoch over this worker
    count, then full epochs), or from the start. Returns it and a description of the resume
    (`epoch`, `consumed_rows`, `remainder_rows`, `untrainable_rows`) for the summary."""
    epochs = int(cfg["train"]["epochs"]) if cfg["train"]["max_steps"] == -1 else None
    position = read_position(ckpt_dir) if ckpt_dir is not None else None
    info = {"world_size": world, "epoch": 0, "consumed_rows": 0, "remainder_rows": 0, "untrainable_rows": 0}
    if position is None:
        if ckpt_dir is not None:
            raise RapidfireError(f"scaling.num_workers: checkpoint {os.path.basename(ckpt_dir.rstrip('/'))} has no "
                                 "data position (it was saved by a run with a fixed worker count); resume it with "
                                 "that fixed scaling.num_workers, or start the elastic run under another run.name")
        return ElasticLoader(full, epochs=epochs), info
    epoch, consumed = position
    shares = remainder_shares(num_rows, consumed, world)
    left = num_rows - len(consumed)
    info.update(epoch=epoch, consumed_rows=int(len(consumed)), remainder_rows=int(sum(len(s) for s in shares)),
                untrainable_rows=int(left - sum(len(s) for s in shares)))
    if not len(shares[0]):  # the epoch is done (or fewer rows left than workers): the next epoch
        return ElasticLoader(full, epoch=epoch + 1, epochs=epochs), info
    remainder = ShardLoader(RowSubset(whole, shares[rank]), num_rows=sum(len(s) for s in shares), rank=rank,
                            world_size=world, batch_size=full.batch_size, pad_id=pad_id,
                            prefetch_depth=full.prefetch_depth, seed=full.seed, with_sources=full.with_sources,
                            budget=budget, rank_rows=shares)
    remainder.set_epoch(epoch)
    return ElasticLoader(full, epoch=epoch, remainder=remainder, carried_rows=consumed if rank == 0 else None,
                         epochs=epochs), info


def max_steps(loader: ElasticLoader, start_step: int, accumulation_steps: int) -> int | None:
    """train.max_steps for a `train.epochs` run at this worker count: the steps taken so far plus
    those the rest of the stream takes (None: a train.max_steps run keeps its own)."""
    remaining = loader.remaining_batches()
    if remaining is None:
        return None
    return start_step + optimizer_steps(remaining, len(loader), accumulation_steps)


