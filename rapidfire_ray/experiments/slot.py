"""A training slot: one process that keeps a base model loaded and trains configs on it one chunk
at a time, swapping each config's LoRA adapter, optimizer, LR scheduler and RNG in and out.

The SFT stage's TRL trainer is built for one config per worker group for the whole run; a swap
loop needs the optimizer and schedule restored into a fresh adapter every chunk, so the slot runs
its own small step (`ConfigRun`): the same tokenised rows (data/prepare.py), batched by the
project's `collate`, the same loss as the SFT stage (token-summed cross entropy over the trained
tokens divided by the step's trained-token count: TRL's `num_items_in_batch` normalisation), torch
AdamW with the config's betas/eps/weight decay, transformers' LR schedule, and grad clipping.
"""
from __future__ import annotations

import io
import math
import os
import time
import warnings
from typing import Any

import torch

from ..data.loader import collate
from ..models import load_model, load_tokenizer
from ..models.lora import CAUSAL_LM, apply_lora


def steps_for(num_rows: int, cfg, workers: int = 1) -> int:
    """Optimizer steps one chunk of `num_rows` rows takes for this config on a slot of `workers`
    (a step is per_device_batch_size x gradient_accumulation_steps x workers rows)."""
    per_step = cfg["train"]["per_device_batch_size"] * cfg["train"]["gradient_accumulation_steps"] * workers
    return math.ceil(num_rows / per_step)


class Shard:
    """A slot worker's place in its slot (rank of world). A step's rows are dealt to the workers
    (rows[rank::world]); the step's trained-token count is the whole step's, so the gradients
    summed over the workers (one all-reduce of every trainable gradient, flattened) are the
    gradient of the whole step, as on one worker with world x the batch."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    def step_batches(self, rows: list[dict], micro: int, accum: int, pad_id: int):
        """(start, this worker's micro-batches, the step's trained tokens) for every step of `rows`."""
        per_step = micro * accum * self.world
        for start in range(0, len(rows), per_step):
            step_rows = rows[start:start + per_step]
            whole = [collate(step_rows[i:i + micro], pad_id) for i in range(0, len(step_rows), micro)]
            items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in whole)
            if self.world == 1:
                yield whole, items
                continue
            mine = step_rows[self.rank::self.world]
            yield [collate(mine[i:i + micro], pad_id) for i in range(0, len(mine), micro)], items

    def my_rows(self, rows: list[dict]) -> list[dict]:
        return rows if self.world == 1 else rows[self.rank::self.world]

    def sum_grads(self, params: list[torch.Tensor]) -> None:
        """Every worker's gradients summed (one all-reduce); a worker without rows adds zeros."""
        if self.world == 1:
            return
        import torch.distributed as dist

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the workers (one all-reduce)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        dist.all_reduce(values)
        return values


class ConfigRun:
    """One config on a slot's base model: its adapter, optimizer, schedule and RNG, trained step by
    step. `state()` is everything needed to continue exactly; `release()` hands the base back."""

    def __init__(self, base: torch.nn.Module, cfg: dict, total_steps: int, state: dict | None = None,
                 device: str = "cpu"):
        self.cfg, self.device = cfg, device
        if state is None:
            torch.manual_seed(cfg["run"]["seed"])  # the adapter's init, then its dropout, from the config's seed
        self.model = apply_lora(base, cfg["model"]["lora"], CAUSAL_LM, cfg["model"]["name"])
        self.model.train()
        self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg)
        self.step = 0
        if state is not None:
            self._restore_weights(state)
        self.scheduler, self.schedule = make_scheduler(self.optimizer, cfg, total_steps, state)
        if state is not None:
            torch.set_rng_state(state["rng"])

    def _restore_weights(self, state: dict) -> None:
        from peft import set_peft_model_state_dict

        unexpected = set_peft_model_state_dict(self.model, state["adapter"]).unexpected_keys
        if unexpected:
            raise ValueError(f"adapter state does not fit this config's LoRA ({len(unexpected)} unexpected keys)")
        restore_optimizer(self.optimizer, state, self.cfg)
        self.step = state["step"]

    def state(self) -> dict:
        from peft import get_peft_model_state_dict

        adapter = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.model, save_embedding_layers=False).items()}
        return {"adapter": adapter, "optimizer": _to_cpu(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(), "schedule": self.schedule, "rng": torch.get_rng_state(), "step": self.step,
                "lora": dict(self.cfg["model"]["lora"])}

    def release(self) -> torch.nn.Module:
        """The base model without this config's adapter (for the next config)."""
        base = self.model.unload()
        self.model = None
        return base

    def train_rows(self, rows: list[dict], pad_id: int, shard: Shard | None = None) -> list[float]:
        """Train on `rows` in order, one optimizer step per per_device_batch_size x accumulation
        (x the slot's workers) rows; the loss of each step."""
        shard = shard or Shard()
        t = self.cfg["train"]
        params = [p for p in self.model.parameters() if p.requires_grad]
        losses = []
        for batches, items in shard.step_batches(rows, t["per_device_batch_size"], t["gradient_accumulation_steps"],
                                                 pad_id):
            total = torch.zeros((), dtype=torch.float64, device=self.device)  # on the device: no sync per batch
            for batch in batches:
                loss = _summed_loss(self.model, batch, self.device) / max(1, items)
                loss.backward()
                total += loss.detach().double()
            shard.sum_grads(params)
            if t["grad_clip"] > 0:
                torch.nn.utils.clip_grad_norm_(params, t["grad_clip"])
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            losses.append(total)
        return shard.sum(torch.stack(losses)).tolist() if losses else []

    @torch.no_grad()
    def evaluate(self, rows: list[dict], pad_id: int, shard: Shard | None = None) -> float:
        """Held-out loss: summed cross entropy over every trained token of `rows` / their count."""
        shard = shard or Shard()
        self.model.eval()
        size = self.cfg["train"]["per_device_batch_size"]
        mine = shard.my_rows(rows)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed loss, trained tokens
        try:
            for i in range(0, len(mine), size):
                batch = collate(mine[i:i + size], pad_id)
                sums[0] += _summed_loss(self.model, batch, self.device).double()
                sums[1] += int((batch["labels"][:, 1:] != -100).sum())
        finally:
            self.model.train()
        total, items = shard.sum(sums).tolist()
        return total / max(1, items)


def make_optimizer(params: list, cfg: dict) -> torch.optim.Optimizer:
    """A config's optimizer over its adapter's parameters: torch AdamW with its values."""
    o = cfg["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"])


def restore_optimizer(optimizer, state: dict, cfg: dict) -> None:
    """The state's AdamW moments, with this config's values (a warm clone's may differ)."""
    optimizer.load_state_dict(state["optimizer"])
    o = cfg["optimizer"]["params"]
    for group in optimizer.param_groups:
        group.update(lr=o["lr"], initial_lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                     weight_decay=o["weight_decay"])


def make_scheduler(optimizer, cfg: dict, total_steps: int, state: dict | None):
    """(transformers' LR schedule for this config, its description). From a state: at the state's
    position (its own schedule), or this config's schedule stepped to the state's step (a warm
    clone with other values)."""
    from transformers import get_scheduler

    t, o = cfg["train"], cfg["optimizer"]["params"]
    schedule = [o["lr"], t["lr_scheduler"], t["warmup_steps"], max(1, total_steps)]
    scheduler = get_scheduler(t["lr_scheduler"], optimizer, num_warmup_steps=t["warmup_steps"],
                              num_training_steps=max(1, total_steps))
    if state is not None:
        if state.get("schedule") == schedule:
            scheduler.load_state_dict(state["scheduler"])
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr  # (load_state_dict restores the schedule's position, not the groups' lr)
        else:
            for _ in range(state["step"]):
                scheduler.step()
    return scheduler, schedule


def _summed_loss(model, batch: dict, device: str) -> torch.Tensor:
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def dumps(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)  # our own state: tensors, numbers, dicts; never unpickle


def write_state(path: str, data: bytes) -> None:
    """A config's state at a chunk boundary, atomically (a lost slot or --resume reads it back)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Slot:
    """A slot's process (a Ray actor in an experiment): the base model stays loaded between chunks.
    A slot of `experiment.resources.workers` > 1 is that many of these, joined (`join`) into one
    torch.distributed group: every call goes to all of them with the same arguments."""

    def __init__(self, model_name: str, threads: int = 1, use_gpu: bool = False):
        torch.set_num_threads(max(1, threads))
        # peft's get_peft_model trips transformers' deprecation of is_gradient_checkpointing (its chatter)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        import peft  # noqa: F401 - imported once here, so the first swap-in measures a swap, not an import
        import transformers.optimization  # noqa: F401
        self.device = "cuda" if use_gpu else "cpu"
        self.model_name = model_name
        self.tokenizer = load_tokenizer(model_name)
        self.pad_id = self.tokenizer.pad_token_id
        self.base = self._load_base()
        self.shard = Shard()

    def _load_base(self) -> torch.nn.Module:
        from ..faults import cap_forward_rows

        base = load_model(self.model_name).to(self.device)
        cap_forward_rows(base)  # (only where RAPIDFIRE_INJECT_OOM_ROWS is set)
        return base

    def rendezvous(self) -> tuple[str, int]:
        """(this worker's node address, a free port): where a multi-worker slot's group meets."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float = 600.0) -> None:
        """Become worker `rank` of a slot of `world` workers (torch.distributed: gloo, nccl on GPUs)."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", init_method=f"tcp://{address}:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        self.shard = Shard(rank, world)

    def train_chunk(self, cfg: dict, state: Any, rows: list[dict], eval_rows: list[dict], total_steps: int,
                    state_path: str | None) -> tuple[dict, bytes]:
        """Swap the config in (its state bytes, or a fresh adapter for None), train `rows`, evaluate,
        swap it out; returns (record, state bytes: empty on a multi-worker slot's other workers).
        Swap times are measured around each side."""
        run, losses, eval_loss, (data,), times = self._cycle(
            lambda: ConfigRun(self.base, cfg, total_steps, loads(state) if state is not None else None, self.device),
            rows, eval_rows, lambda run: [run.state()], [state_path])
        return _record(losses, run.step, eval_loss, *times, len(data)), data

    def train_group(self, cfgs: list[dict], rows: list[dict], eval_rows: list[dict], totals: list[int],
                    state_paths: list, *states) -> list:
        """train_chunk for k co-batched configs in one pass (cobatch.CoBatchRun): k records, then k
        state bytes. `states` come last, one argument each (Ray resolves top-level object refs only).
        The group's train, eval and swap times are shared equally by its records."""
        from .cobatch import CoBatchRun

        k = len(cfgs)
        run, losses, eval_losses, blobs, times = self._cycle(
            lambda: CoBatchRun(self.base, cfgs, totals, [loads(s) if s is not None else None for s in states],
                               self.device),
            rows, eval_rows, lambda run: [run.state(j) for j in range(k)], state_paths)
        records = [{**_record(losses[j], run.steps[j], eval_losses[j], *(t / k for t in times), len(blobs[j])),
                    "co_batch": k} for j in range(k)]
        return records + blobs

    def _cycle(self, make_run, rows, eval_rows, states_of, state_paths):
        """Swap in (`make_run`), train, evaluate, swap out: (run, losses, eval, state bytes per
        path, (train_s, eval_s, swap_in_s, swap_out_s)). The workers of a slot hold the same
        states: the first one saves them (the others return empty bytes)."""
        t0 = time.perf_counter()
        try:
            run = make_run()
        except BaseException:
            self.base = self._load_base()  # adapters may be half applied
            raise
        swap_in = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            losses = run.train_rows(rows, self.pad_id, self.shard)
            train_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            evals = run.evaluate(eval_rows, self.pad_id, self.shard)
            eval_s = time.perf_counter() - t2
            t3 = time.perf_counter()
            blobs = [b""] * len(state_paths)
            if self.shard.rank == 0:
                blobs = [dumps(state) for state in states_of(run)]
                for path, data in zip(state_paths, blobs):
                    if path:
                        write_state(path, data)
        finally:
            self.base = run.release()
        return run, losses, evals, blobs, (train_s, eval_s, swap_in, time.perf_counter() - t3)


def _record(losses: list[float], step: int, eval_loss: float, train_s: float, eval_s: float, swap_in: float,
            swap_out: float, state_bytes: int) -> dict:
    return {"steps": len(losses), "step": step, "train_loss": losses[-1] if losses else None,
            "eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)), "train_s": train_s,
            "eval_s": eval_s, "swap_in_s": swap_in, "swap_out_s": swap_out, "state_bytes": state_bytes,
            "pid": os.getpid(), "node": _node_id()}


def _node_id() -> str | None:
    """The Ray node this slot runs on (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
