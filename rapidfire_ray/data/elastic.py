"""Elastic runs' data position: every row once per epoch, across changes of the worker count.

With every checkpoint each rank writes `position-rank<r>.npz` (its epoch and the global rows
it has trained on in it); at a resume with another worker count the rest of that epoch is
shared by the new workers, then full epochs follow with the new shard plan. `ElasticLoader` is
that stream and owns the epoch counter. Why a fixed-size resume does not carry over, and how
the loader meets transformers' epochs: docs/data.md.

Fixed-size runs keep the plain `ShardLoader` and its resume.
"""
from __future__ import annotations

import glob
import math
import os
from typing import Any, Iterator

import numpy as np

from .loader import ShardLoader
from .sharding import shard_bounds

POSITION_PREFIX = "position-rank"


def write_position(folder: str, rank: int, epoch: int, rows: np.ndarray) -> str:
    """This rank's position (epoch, rows trained on in it) into its checkpoint folder."""
    path = os.path.join(folder, f"{POSITION_PREFIX}{rank}.npz")
    tmp = path + ".tmp-write.npz"
    np.savez_compressed(tmp, epoch=np.int64(epoch), rows=np.asarray(rows, dtype=np.int64))
    os.replace(tmp, path)
    return path


def read_position(folder: str) -> tuple[int, np.ndarray] | None:
    """(epoch, sorted consumed rows) from a checkpoint's position files; None if it has none
    (a checkpoint of a fixed-size run). ValueError when the ranks disagree on the epoch."""
    paths = sorted(glob.glob(os.path.join(folder, f"{POSITION_PREFIX}*.npz")))
    if not paths:
        return None
    epochs, rows = set(), []
    for path in paths:
        with np.load(path, allow_pickle=False) as f:
            epochs.add(int(f["epoch"]))
            rows.append(f["rows"])
    if len(epochs) != 1:
        raise ValueError(f"the position files of {folder} are in different epochs {sorted(epochs)}")
    return epochs.pop(), np.unique(np.concatenate(rows))


def remainder_shares(num_rows: int, consumed: np.ndarray, world_size: int) -> list[np.ndarray]:
    """The rows of the epoch not yet trained on, shared by `world_size` ranks: contiguous runs of
    the sorted remainder, sizes differing by at most one. All empty when fewer rows are left than
    ranks (the ranks could not stay in lockstep; the caller reports them as not trained)."""
    rest = np.setdiff1d(np.arange(num_rows, dtype=np.int64), consumed, assume_unique=False)
    if len(rest) < world_size:
        return [np.zeros(0, dtype=np.int64) for _ in range(world_size)]
    return [rest[s:e] for s, e in shard_bounds(len(rest), world_size)]


class RowSubset:
    """The rows `rows` (global indices, ascending) of a whole dataset read in dataset order
    (`preserve_order`), as a shard: `iter_batches` like a Ray Data iterator's."""

    def __init__(self, whole, rows: np.ndarray):
        self.whole = whole
        self.rows = np.asarray(rows, dtype=np.int64)

    def iter_batches(self, *, batch_size: int, batch_format: str = "numpy", prefetch_batches: int = 1,
                     drop_last: bool = False) -> Iterator[dict[str, Any]]:
        start = 0
        for b in self.whole.iter_batches(batch_size=max(batch_size, 256), batch_format="numpy",
                                         prefetch_batches=prefetch_batches, drop_last=False):
            n = len(next(iter(b.values())))
            lo, hi = np.searchsorted(self.rows, [start, start + n])
            if hi > lo:
                pick = self.rows[lo:hi] - start
                yield {k: v[pick] for k, v in b.items()}
            start += n
        if start and self.rows.size and self.rows[-1] >= start:
            raise RuntimeError(f"the dataset has {start} rows; row {int(self.rows[-1])} was asked for")


class ElasticLoader:
    """The stream of batches of an elastic run's worker: the rest of the epoch it resumed in
    (`remainder`, a ShardLoader over this rank's share of the rows not yet trained on), then
    full epochs of `full` (this worker count's shard), up to `epochs` epochs (None: until the
    trainer stops at train.max_steps)."""

    def __init__(self, full: ShardLoader, *, epoch: int = 0, remainder: ShardLoader | None = None,
                 carried_rows: np.ndarray | None = None, epochs: int | None = None):
        self.full = full
        self.remainder = remainder
        self.epoch = epoch
        self.epochs = epochs
        # rows of the current epoch trained before this worker group started (rank 0 carries them)
        self._carried = np.zeros(0, dtype=np.int64) if carried_rows is None else np.asarray(carried_rows)
        self._segment: ShardLoader | None = None
        self._stream: Iterator | None = None
        self._handed = 0  # batches handed out
        self._remaining = self.remaining_batches()

    # what telemetry and the worker read, whichever segment is running
    @property
    def wait_s(self) -> float:
        return self.full.wait_s + (self.remainder.wait_s if self.remainder is not None else 0.0)

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self.full.wait_s = value
        if self.remainder is not None:
            self.remainder.wait_s = 0.0

    def _sum(self, name: str) -> int:
        return getattr(self.full, name) + (getattr(self.remainder, name) if self.remainder is not None else 0)

    rows_yielded = property(lambda self: self._sum("rows_yielded"))
    tokens_yielded = property(lambda self: self._sum("tokens_yielded"))
    padded_tokens_yielded = property(lambda self: self._sum("padded_tokens_yielded"))
    prefetch_depth = property(lambda self: self.full.prefetch_depth)

    def set_prefetch_depth(self, depth: int) -> None:
        self.full.set_prefetch_depth(depth)
        if self.remainder is not None:
            self.remainder.set_prefetch_depth(depth)

    def __len__(self) -> int:
        """Batches transformers takes per iter(): the whole rest of a `train.epochs` run (so the
        last accumulation group of the run ends an "epoch" of transformers and is stepped), one
        full epoch of a `train.max_steps` run."""
        return self._remaining if self._remaining is not None else len(self.full)

    def set_epoch(self, epoch: int) -> None:
        """transformers' epoch number: ignored, the stream counts its own epochs."""

    def remaining_batches(self) -> int | None:
        """Batches this rank has still to hand out (None: no epoch limit)."""
        if self.epochs is None:
            return None
        rest = len(self.remainder) if self.remainder is not None else 0
        full_epochs = self.epochs - self.epoch - (1 if self.remainder is not None else 0)
        return rest + max(0, full_epochs) * len(self.full)

    @property
    def finished(self) -> bool:
        """The last epoch's last batch has been handed out."""
        return self._remaining is not None and self._handed >= self._remaining

    def position(self) -> tuple[int, np.ndarray]:
        """(epoch, global rows this rank trained on in it, plus the carried ones)."""
        mine = self._segment.epoch_rows() if self._segment is not None else np.zeros(0, dtype=np.int64)
        return self.epoch, np.concatenate([self._carried, mine])

    def _batches(self) -> Iterator[dict[str, Any]]:
        if self.remainder is not None:
            self._segment = self.remainder
            yield from self.remainder
            self._next_epoch()
        while self.epochs is None or self.epoch < self.epochs:
            self.full.set_epoch(self.epoch)
            self._segment = self.full
            yield from self.full
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._carried = np.zeros(0, dtype=np.int64)
        self._segment = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._stream is None:
            self._stream = self._batches()
        for _ in range(len(self)):
            batch = next(self._stream, None)
            if batch is None:
                return
            self._handed += 1
            yield batch


def optimizer_steps(batches: int, per_chunk: int, accumulation: int) -> int:
    """Optimizer steps transformers takes for `batches` micro-batches handed out in chunks of
    `per_chunk` (its epochs: each ends with a shorter accumulation group)."""
    steps = 0
    while batches > 0:
        n = min(per_chunk, batches)
        steps += math.ceil(n / accumulation)
        batches -= n
    return steps
