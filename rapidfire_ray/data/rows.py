"""Row functions that Ray Data runs in its tasks (parse, order key, token counts, column sums).

Every Ray Data task that calls one of these imports this module in a Ray worker process, often a
fresh one: it imports nothing heavier than the file formats (no torch, transformers or Ray Train,
which cost seconds per process on a small machine).
"""
from __future__ import annotations

import hashlib
from functools import partial
from typing import Sequence

import numpy as np

from .sources import parse_file


def parse(row: dict, fmt: str) -> list[dict]:
    """One file read by `read_binary_files(include_paths=True)` -> its records, good and bad."""
    return parse_file(row["path"], row["bytes"], fmt)


def order_key(batch: dict, seed: int) -> dict:
    """A seeded hash of each row's source: sorting by it is a deterministic global shuffle,
    whatever the block layout."""
    batch["order"] = [int.from_bytes(hashlib.blake2b(f"{seed}:{s}".encode(), digest_size=8).digest(), "big") >> 1
                      for s in batch["source"]]
    return batch


def count_tokens(batch: dict) -> dict:
    """Token rows -> + ``num_tokens`` (row length), ``num_trained`` (loss-masked tokens)."""
    batch["num_tokens"] = [len(x) for x in batch["input_ids"]]
    batch["num_trained"] = [int(m.sum()) for m in batch["loss_mask"]]
    batch["truncated"] = [int(t) for t in batch["truncated"]]
    return batch


def _block_sums(batch: dict, columns: Sequence[str]) -> dict:
    return {c: np.asarray([int(np.asarray(batch[c], dtype=np.int64).sum())]) for c in columns}


def column_sums(ds, columns: Sequence[str]) -> dict[str, int]:
    """Sums of integer columns in one pass of plain map tasks (Ray Data's `sum` starts a
    hash-shuffle aggregation per call, seconds each on a small cluster)."""
    totals = dict.fromkeys(columns, 0)
    parts = ds.select_columns(list(columns)).map_batches(partial(_block_sums, columns=tuple(columns)),
                                                         batch_size=None, batch_format="numpy")
    for row in parts.take_all():
        for c in columns:
            totals[c] += int(row[c])
    return totals
