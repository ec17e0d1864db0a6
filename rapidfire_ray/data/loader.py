"""The training dataloader seam: a worker's Ray Data shard -> padded torch batches for TRL.

`ShardLoader` is what our trainers return from `get_train_dataloader()`. It reads the worker's
shard with Ray Data's background prefetching (`data.prefetch_depth` batches ahead), cuts it into
batches (`fixed`: `per_device_batch_size` rows, reshuffled every epoch with a seeded buffer;
`token_budget`: the plan of `batching.py`), keeps every rank at the same number of batches per
epoch (so DDP ranks stay in lockstep while every row is used exactly once), can skip the
batches already trained on when a run resumes, and measures how long the step waited for data.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from .batching import lockstep, token_budget_batches, window_of
from .sharding import shard_bounds

SHUFFLE_BUFFER_ROWS = 1024


@dataclass(frozen=True)
class TokenBudget:
    """What a rank needs to plan token-budget batches in lockstep with the others."""

    lengths: np.ndarray  # token count of every training row, in dataset order (all ranks)
    max_tokens: int  # padded tokens per batch (rows x longest row)
    max_rows: int | None  # rows per batch at most (None: only the budget limits)
    window: int  # rows sorted by length together
    max_padding: float = 1.0  # padding tokens per batch at most, as a fraction of its tokens

    @classmethod
    def from_config(cls, cfg, lengths) -> TokenBudget | None:
        """The run's token-budget settings (None with fixed batches); `cfg` as DictConfig or dict."""
        db = cfg["data"]["dynamic_batch"]
        if db["strategy"] != "token_budget":
            return None
        max_tokens = db["max_tokens"] or cfg["train"]["per_device_batch_size"] * cfg["data"]["max_length"]
        return cls(lengths=np.asarray(lengths), max_tokens=max_tokens, max_rows=db["max"], window=db["window"],
                   max_padding=db["max_padding"])

    def plan(self, world_size: int) -> list[list[list[int]]]:
        """Every rank's batches (local row indices), in lockstep. ValueError if impossible."""
        plans = [token_budget_batches(self.lengths[s:e], self.max_tokens, self.max_rows, self.window,
                                      self.max_padding)
                 for s, e in shard_bounds(len(self.lengths), world_size)]
        return lockstep(plans)


def batches_per_epoch(num_rows: int, world_size: int, batch_size: int) -> int:
    """Batches every rank yields per epoch: what the smallest shard needs at `batch_size`."""
    return math.ceil((num_rows // world_size) / batch_size)


def batch_plan(shard_rows: int, num_batches: int, batch_size: int) -> list[int]:
    """Batch sizes for one rank: full batches, the last one taking the rest (at most one row more
    than `batch_size`, on ranks whose shard holds the one extra row)."""
    return [batch_size] * (num_batches - 1) + [shard_rows - batch_size * (num_batches - 1)]


def collate(rows: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; labels are -100 on padding and on tokens not trained on."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = torch.as_tensor(r["input_ids"], dtype=torch.long)
        n = len(ids)
        input_ids[i, :n] = ids
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.where(torch.as_tensor(r["loss_mask"], dtype=torch.bool), ids, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ShardLoader:
    """Iterable of batches over one rank's shard; `len()` is the same on every rank."""

    def __init__(self, shard, *, num_rows: int, rank: int, world_size: int, batch_size: int, pad_id: int,
                 prefetch_depth: int = 3, seed: int = 0, with_sources: bool = False,
                 budget: TokenBudget | None = None):
        if num_rows < world_size:
            raise ValueError(f"{num_rows} training rows cannot be shared by {world_size} workers")
        start, end = shard_bounds(num_rows, world_size)[rank]
        self.shard = shard
        self.shard_rows = end - start
        self.batch_size = batch_size
        self.budget = budget
        if budget is None:
            self.num_batches = batches_per_epoch(num_rows, world_size, batch_size)
        else:
            self.plan = budget.plan(world_size)[rank]
            self.num_batches = len(self.plan)
        self.pad_id = pad_id
        self.prefetch_depth = prefetch_depth
        self.seed = seed
        self.with_sources = with_sources
        self.epoch = 0
        self._skip = 0
        self.wait_s = 0.0  # seconds the consumer spent blocked on the next batch; telemetry drains it
        self.rows_yielded = 0
        self.tokens_yielded = 0  # real tokens (not padding)
        self.padded_tokens_yielded = 0  # tokens including padding: what the model computes on

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, num_batches: int) -> None:
        """Skip the first `num_batches` of the next epoch iterated (resume inside an epoch)."""
        self._skip = num_batches

    def _stored_rows(self) -> Iterator[dict[str, Any]]:
        """The shard's rows in stored order, read with Ray Data's background prefetching."""
        for b in self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                         prefetch_batches=self.prefetch_depth, drop_last=False):
            for i in range(len(b["input_ids"])):
                yield {"input_ids": b["input_ids"][i], "loss_mask": b["loss_mask"][i], "source": b["source"][i]}

    def _shuffled_rows(self) -> Iterator[dict[str, Any]]:
        """The shard's rows in a seeded per-epoch order: a shuffle buffer of SHUFFLE_BUFFER_ROWS
        rows (our own, so the order is reproducible and a resume can skip exactly)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        buffer: list[dict[str, Any]] = []
        for row in self._stored_rows():
            buffer.append(row)
            if len(buffer) >= SHUFFLE_BUFFER_ROWS:
                j = int(rng.integers(len(buffer)))
                buffer[j], buffer[-1] = buffer[-1], buffer[j]
                yield buffer.pop()
        for j in rng.permutation(len(buffer)):
            yield buffer[j]

    def _fixed_batches(self) -> Iterator[list[dict[str, Any]]]:
        rows = self._shuffled_rows()
        for index, size in enumerate(batch_plan(self.shard_rows, self.num_batches, self.batch_size)):
            chunk = [row for _, row in zip(range(size), rows)]
            if len(chunk) != size:
                raise RuntimeError(f"data shard ran out: expected {size} rows for batch {index}, got {len(chunk)}")
            yield chunk

    def _budget_batches(self) -> Iterator[list[dict[str, Any]]]:
        """The planned token-budget batches, window by window, in a seeded per-epoch order
        inside each window."""
        window = self.budget.window
        rows = self._stored_rows()
        by_window: dict[int, list[list[int]]] = {}
        for batch in self.plan:
            by_window.setdefault(window_of(batch, window), []).append(batch)
        for w in sorted(by_window):
            base = w * window
            buffer = [row for _, row in zip(range(min(window, self.shard_rows - base)), rows)]
            batches = by_window[w]
            for j in np.random.default_rng([self.seed, self.epoch, w]).permutation(len(batches)):
                yield [buffer[i - base] for i in batches[j]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip, self._skip = self._skip, 0
        batches = self._fixed_batches() if self.budget is None else self._budget_batches()
        index = 0
        while True:
            t0 = time.perf_counter()
            chunk = next(batches, None)
            if chunk is None:
                break
            index += 1
            if index <= skip:
                continue
            size = len(chunk)
            batch = collate(chunk, self.pad_id)
            if self.with_sources:
                batch["sources"] = [str(r["source"]) for r in chunk]
            self.wait_s += time.perf_counter() - t0
            self.rows_yielded += size
            self.tokens_yielded += int(batch["attention_mask"].sum())
            self.padded_tokens_yielded += batch["attention_mask"].numel()
            yield batch
        if index != self.num_batches:
            raise RuntimeError(f"data shard gave {index} batches, {self.num_batches} were planned")
