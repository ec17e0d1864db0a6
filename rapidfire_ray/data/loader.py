"""The training dataloader seam: a worker's Ray Data shard -> padded torch batches for TRL.

`ShardLoader` is what our trainers return from `get_train_dataloader()`. It reads the worker's
shard with Ray Data's background prefetching (`data.prefetch_depth` batches ahead), cuts it into
batches (`fixed`: `per_device_batch_size` rows, reshuffled every epoch with a seeded buffer;
`token_budget`, `memory_aware`: the plan of `batching.py`), keeps every rank at the same number of batches per
epoch (so DDP ranks stay in lockstep while every row is used exactly once), can skip the
batches already trained on when a run resumes, and measures how long the step waited for data.

Prefetch: a background thread prepares the next batches (reads the rows, cuts and pads them)
while the step computes, keeping `prefetch_depth` batches ready; the depth is read before every
batch, so a depth changed during the run (`set_prefetch_depth`, by `rapidfire monitor`'s
rules) applies from the next batch on. Depth 0 prepares each batch only when the step asks for
it. `RAPIDFIRE_DATA_DELAY_S` (seconds, in the workers' environment) makes every batch that much
slower to prepare: an injected slow data source, for tests and demonstrations.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..faults import data_delay_s
from ..memory.estimate import GIB, MemoryModel
from .batching import RowsFit, cut_batches, lockstep, token_budget_rows, window_bounds, window_of
from .preference import collate_pairs, is_pair_row
from .sharding import shard_bounds

SHUFFLE_BUFFER_ROWS = 1024
_END = object()


@dataclass(frozen=True)
class DynamicBatches:
    """What a rank needs to plan dynamic batches (`token_budget`, `memory_aware`) in lockstep
    with the others: every row's length and the rule for how many rows a batch may hold."""

    lengths: np.ndarray  # token count of every training row, in dataset order (all ranks)
    rows_fit: RowsFit  # padded width -> most rows per batch
    window: int  # rows sorted by length together
    max_padding: float = 1.0  # padding tokens per batch at most, as a fraction of its tokens
    min_rows: int = 1  # batches are not cut below this many rows where the rows exist
    description: str = ""
    memory: MemoryModel | None = None  # memory_aware: the model the rows come from
    free_bytes: int = 0  # memory_aware: free memory measured before the model was loaded
    budget_bytes: int = 0  # memory_aware: free_bytes x threshold

    @classmethod
    def token_budget(cls, cfg, lengths) -> DynamicBatches:
        """`cfg` as DictConfig or dict."""
        db = cfg["data"]["dynamic_batch"]
        sides = 2 if cfg["data"].get("format") == "preference" else 1  # a preference pair is two rows of a batch
        max_tokens = db["max_tokens"] or sides * cfg["train"]["per_device_batch_size"] * cfg["data"]["max_length"]
        return cls(lengths=np.asarray(lengths), rows_fit=token_budget_rows(max_tokens, db["max"]), window=db["window"],
                   max_padding=db["max_padding"], description=f"{max_tokens} padded tokens per batch")

    @classmethod
    def memory_aware(cls, cfg, lengths, model: MemoryModel, free_bytes: int) -> DynamicBatches:
        """Rows per batch = (free memory x threshold - the model's fixed state) / the memory of one
        sample at the batch's padded width, clamped to [min, max]."""
        db = cfg["data"]["dynamic_batch"]
        lo, hi = db["min"] or 1, db["max"]
        budget = int(free_bytes * db["memory_threshold"])
        left = budget - model.static_bytes()
        if left <= 0:
            raise ValueError(f"the model's fixed state ({model.static_bytes() / GIB:.2f} GiB: weights, gradients, "
                             f"optimizer) does not fit in {db['memory_threshold']} x {free_bytes / GIB:.2f} GiB free; "
                             "raise data.dynamic_batch.memory_threshold, use more memory per worker or fewer "
                             "workers per node")

        def rows_fit(width: int) -> int:
            rows = left // model.batch_bytes(1, width)
            if rows < 1 and lo == 1:
                raise ValueError(f"one row of {width} tokens needs {model.batch_bytes(1, width) / GIB:.2f} GiB, "
                                 f"more than the {left / GIB:.2f} GiB left for activations; lower data.max_length or "
                                 "raise data.dynamic_batch.memory_threshold")
            rows = max(lo, rows)
            return rows if hi is None else min(hi, rows)

        return cls(lengths=np.asarray(lengths), rows_fit=rows_fit, window=db["window"], max_padding=db["max_padding"],
                   min_rows=lo, memory=model, free_bytes=free_bytes, budget_bytes=budget, description=(f"{budget / GIB:.2f} GiB budget ({db['memory_threshold']} x "
                                             f"{free_bytes / GIB:.2f} GiB free), fixed state "
                                             f"{model.static_bytes() / GIB:.2f} GiB"))

    @classmethod
    def from_config(cls, cfg, lengths, model: MemoryModel | None = None, free_bytes: int | None = None):
        """The run's dynamic batching (None with fixed batches)."""
        strategy = cfg["data"]["dynamic_batch"]["strategy"]
        if strategy == "token_budget":
            return cls.token_budget(cfg, lengths)
        if strategy == "memory_aware":
            return cls.memory_aware(cfg, lengths, model, free_bytes)
        return None

    def plan(self, world_size: int, rank_rows: list[np.ndarray] | None = None) -> list[list[list[int]]]:
        """Every rank's batches (indices into its shard), in lockstep. ValueError if impossible.
        `rank_rows`: each rank's rows as global indices in shard order (default: contiguous shards)."""
        if rank_rows is None:
            rank_rows = [np.arange(s, e) for s, e in shard_bounds(len(self.lengths), world_size)]
        plans = [cut_batches(self.lengths[rows], self.rows_fit, self.window, self.max_padding, self.min_rows)
                 for rows in rank_rows]
        return lockstep(plans, self.min_rows)


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
        ids = torch.tensor(r["input_ids"], dtype=torch.long)  # a copy: Ray's arrays are read-only
        n = len(ids)
        input_ids[i, :n] = ids
        attention_mask[i, :n] = 1
        mask = r.get("loss_mask")
        labels[i, :n] = ids if mask is None else torch.where(torch.tensor(mask, dtype=torch.bool), ids, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ShardLoader:
    """Iterable of batches over one rank's shard; `len()` is the same on every rank."""

    def __init__(self, shard, *, num_rows: int, rank: int, world_size: int, batch_size: int, pad_id: int,
                 prefetch_depth: int = 3, seed: int = 0, with_sources: bool = False,
                 budget: DynamicBatches | None = None, rank_rows: list[np.ndarray] | None = None):
        if num_rows < world_size:
            raise ValueError(f"{num_rows} training rows cannot be shared by {world_size} workers")
        start, end = shard_bounds(num_rows, world_size)[rank]
        self.shard = shard
        self.rank = rank
        self.shard_rows = end - start
        self.batch_size = batch_size
        self.budget = budget
        if budget is None:
            self.num_batches = batches_per_epoch(num_rows, world_size, batch_size)
        else:
            self.plan = budget.plan(world_size, rank_rows)[rank]
            self.num_batches = len(self.plan)
        # This rank's rows as global indices, in shard order.
        self.rank_rows = rank_rows[rank] if rank_rows is not None else np.arange(start, end)
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
        self._epoch_pos: list[int] = []  # shard places of the rows handed out in the current pass

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_rows(self) -> np.ndarray:
        """Global indices of the rows handed out in the current pass over the shard (skipped
        batches not included)."""
        return self.rank_rows[np.asarray(self._epoch_pos, dtype=np.int64)]

    def skip_next(self, num_batches: int) -> None:
        """Skip the first `num_batches` of the next epoch iterated (resume inside an epoch)."""
        self._skip = num_batches

    def _stored_rows(self) -> Iterator[dict[str, Any]]:
        """The shard's rows in stored order, read with Ray Data's background prefetching."""
        pos = 0  # the row's place in the shard: self.rank_rows[pos] is its global index
        for b in self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                         prefetch_batches=self.prefetch_depth, drop_last=False):
            masks, sources = b.get("loss_mask"), b.get("source")  # optional for users' own datasets
            if "chosen_ids" in b:  # preference pairs (data/preference.py)
                for i in range(len(b["chosen_ids"])):
                    yield {"chosen_ids": b["chosen_ids"][i], "rejected_ids": b["rejected_ids"][i],
                           "source": None if sources is None else sources[i], "pos": pos}
                    pos += 1
                continue
            for i in range(len(b["input_ids"])):
                yield {"input_ids": b["input_ids"][i], "loss_mask": None if masks is None else masks[i],
                       "source": None if sources is None else sources[i], "pos": pos}
                pos += 1

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
        """The planned dynamic batches, window by window, in a seeded per-epoch order
        inside each window."""
        bounds = window_bounds(self.shard_rows, self.budget.window, self.budget.min_rows)
        rows = self._stored_rows()
        by_window: dict[int, list[list[int]]] = {}
        for batch in self.plan:
            by_window.setdefault(window_of(batch, bounds), []).append(batch)
        for w in sorted(by_window):
            base, end = bounds[w]
            buffer = [row for _, row in zip(range(end - base), rows)]
            batches = by_window[w]
            for j in np.random.default_rng([self.seed, self.epoch, w]).permutation(len(batches)):
                yield [buffer[i - base] for i in batches[j]]

    def set_prefetch_depth(self, depth: int) -> None:
        """Batches to keep ready from the next batch on (the run's `data.prefetch_depth` knob)."""
        self.prefetch_depth = max(0, int(depth))

    def _prepared(self, skip: int) -> Iterator[tuple[dict[str, Any], int]]:
        """(collated batch, rows) for every batch of the epoch after the first `skip`: the
        producer side of the prefetch."""
        batches = self._fixed_batches() if self.budget is None else self._budget_batches()
        delay = data_delay_s()  # an injected slow source (faults.py)
        index = 0
        for chunk in batches:
            index += 1
            if index <= skip:
                continue
            if delay > 0:
                time.sleep(delay)  # an injected slow source (tests): a real wait, seen as data wait
            batch = collate_pairs(chunk, self.pad_id) if is_pair_row(chunk[0]) else collate(chunk, self.pad_id)
            if self.with_sources:
                batch["sources"] = [str(r["source"]) for r in chunk]
            yield batch, [r["pos"] for r in chunk]
        if index != self.num_batches:
            raise RuntimeError(f"data shard gave {index} batches, {self.num_batches} were planned")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip, self._skip = self._skip, 0
        self._epoch_pos = []
        ahead = _Ahead(self._prepared(skip), lambda: self.prefetch_depth)
        try:
            while True:
                t0 = time.perf_counter()
                item = ahead.get()
                if item is _END:
                    break
                batch, positions = item
                self.wait_s += time.perf_counter() - t0
                self._epoch_pos.extend(positions)
                self.rows_yielded += len(positions)
                self.tokens_yielded += int(batch["attention_mask"].sum())
                self.padded_tokens_yielded += batch["attention_mask"].numel()
                yield batch
        finally:
            ahead.close()


class _Ahead:
    """Runs a generator in a background thread and keeps up to `depth()` of its items ready.
    With depth 0 it makes an item only while the consumer waits for one. An exception in the
    generator is raised to the consumer."""

    def __init__(self, source: Iterator, depth):
        self._source = source
        self._depth = depth
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._waiting = False
        self._done = False
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rapidfire-prefetch", daemon=True)
        self._thread.start()

    def _wanted(self) -> bool:
        return len(self._items) < self._depth() or (self._waiting and not self._items)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopped and not self._wanted():
                        self._cond.wait(0.05)  # wakes up for a changed depth too
                    if self._stopped:
                        return
                item = next(self._source, _END)
                with self._cond:
                    if item is _END:
                        self._done = True
                    else:
                        self._items.append(item)
                    self._cond.notify_all()
                if item is _END:
                    return
        except BaseException as e:  # handed to the consumer
            with self._cond:
                self._error = e
                self._done = True
                self._cond.notify_all()

    def get(self):
        """The next item, or `_END` after the last."""
        with self._cond:
            self._waiting = True
            self._cond.notify_all()
            while not self._items and not self._done:
                self._cond.wait()
            self._waiting = False
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            if self._error is not None:
                raise self._error
            return _END

    def close(self) -> None:
        """Stop making items (the consumer stopped early, or finished)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
