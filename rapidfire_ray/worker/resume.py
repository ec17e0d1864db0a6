"""Where a worker group starts: which worker group of the run it is, the checkpoint it resumes
from (every rank the same one), and how far into the epoch that checkpoint was."""
from __future__ import annotations

import json
import os

import ray
import ray.train
import torch

from ..checkpoints import usable_checkpoint
from ..log import say


def start_attempt(board, rank: int) -> int | None:
    """How many worker groups of this run started before this one (rank 0 counts them on the
    board and tells the others); None without a process group (parameter_server)."""
    if not torch.distributed.is_initialized():
        return None
    value = [ray.get(board.start_attempt.remote()) if rank == 0 else None]
    torch.distributed.broadcast_object_list(value, src=0)
    return value[0]


def resume_checkpoint(run_dir: str, board, rank: int, world: int):
    """The checkpoint this worker group resumes from (None: from the start). With a process group,
    rank 0 chooses (`checkpoints.usable_checkpoint`, preferring a fully saved checkpoint newer than
    the one Ray Train registered) and broadcasts the choice, so every rank loads the same step;
    without one (parameter_server) every rank takes Ray Train's registered checkpoint."""
    registered = ray.train.get_checkpoint()

    def fallback(msg: str) -> None:  # rank 0 says it and leaves it for the run summary
        if rank == 0:
            say(msg)
            ray.get(board.note_checkpoint_fallback.remote(msg))

    if not torch.distributed.is_initialized():
        return usable_checkpoint(registered, say=fallback)
    choice = [None]
    if rank == 0:
        chosen = usable_checkpoint(registered, say=fallback, run_dir=run_dir, world_size=world, note=say)
        choice = [None if chosen is None else chosen.path]
    torch.distributed.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if registered is not None and choice[0] == registered.path:
        return registered
    import pyarrow.fs

    fs = registered.filesystem if registered is not None else pyarrow.fs.LocalFileSystem()
    return ray.train.Checkpoint(choice[0], filesystem=fs)


def batches_done_in_epoch(ckpt_dir: str, batches_per_epoch: int, grad_accum: int) -> int:
    """Micro-batches of the current epoch already trained on at the checkpoint's step."""
    with open(os.path.join(ckpt_dir, "trainer_state.json"), encoding="utf-8") as f:
        step = json.load(f)["global_step"]
    updates_per_epoch = max(1, -(-batches_per_epoch // grad_accum))
    return (step % updates_per_epoch) * grad_accum
