"""Build a run's training dataset with Ray Data: read -> validate -> tokenise -> shuffle.

Runs on the cluster's CPUs before the training workers start, so workers never tokenise in
their step loop. The result is materialised in Ray's object store and split exactly across
workers by `sharding.ExactSplitDataConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import ray
import ray.data
from ray.data.expressions import col

from ..errors import RapidfireError
from .preference import NAME as PREFERENCE, PAIR_COLUMNS, PreferenceTokenizer
from . import rows
from .row_report import BAD_ROW_EXAMPLES, RowReport, read_records
from .sources import list_data_files
from .tokenize import SFTTokenizer, tokenize_batch


@dataclass
class DataReport(RowReport):
    empty_after_truncation: int = 0
    rows: int = 0
    truncated_rows: int = 0
    dropped_overlong: int = 0
    tokens: int = 0
    trained_tokens: int = 0

    def describe(self) -> str:
        line = (f"data: {self.rows} rows, {self.tokens} tokens ({self.trained_tokens} trained on) from "
                f"{len(self.files)} file(s); {self.truncated_rows} truncated")
        line += self.bad_rows_note()
        if self.dropped_overlong:
            line += f"; dropped {self.dropped_overlong} row(s) longer than data.max_length (data.overlong: drop)"
        if self.empty_after_truncation:
            line += f"; skipped {self.empty_after_truncation} row(s) with nothing to train on within data.max_length"
        return line


def build_sft_dataset(cfg, num_cpus: int = 1, path: str | None = None, key: str = "data.path"):
    """Return (materialised dataset of token rows, DataReport). Raises RapidfireError on bad data.
    `path`: another file of the same format (e.g. `data.eval_path`, named `key` in errors).
    Preference pairs (`data.format: preference`) become `chosen_ids`/`rejected_ids` rows."""
    d = cfg.data
    path = d.path if path is None else path
    files = list_data_files(path)
    report = DataReport(files=files)
    records = read_records(files, d.format)
    report.rows_read = records.count()
    bad = records.filter(expr=col("error") != "")
    bad_rows = bad.count()
    report.record_bad_rows(bad_rows, bad.take(BAD_ROW_EXAMPLES) if bad_rows else [], d.on_bad_row, key)

    # Spread the rows over enough blocks that tokenisation runs on several CPUs.
    blocks = max(1, min(4 * num_cpus, report.rows_read // 512 + 1))
    good = records.filter(expr=col("error") == "").repartition(blocks)
    tasks = ray.data.TaskPoolStrategy(size=max(1, min(num_cpus, blocks)))
    if d.format == PREFERENCE:  # the pair tokenizer counts its own tokens
        tokens = good.map_batches(partial(tokenize_batch, cls=PreferenceTokenizer, args=(cfg.model.name, d.max_length)),
                                  batch_size=256, compute=tasks).materialize()
    else:
        tokens = (good.map_batches(partial(tokenize_batch, cls=SFTTokenizer,
                                           args=(cfg.model.name, d.format, d.max_length)),
                                   batch_size=256, compute=tasks)
                  .map_batches(rows.count_tokens, batch_size=256)
                  .materialize())
    if d.overlong == "drop":
        report.dropped_overlong = rows.column_sums(tokens, ["truncated"])["truncated"]
        tokens = tokens.filter(expr=col("truncated") == 0).materialize()
    good_rows = tokens.count()
    trainable = tokens.filter(expr=col("num_trained") > 0)
    ds = (trainable.map_batches(partial(rows.order_key, seed=cfg.run.seed), batch_size=1024)
          .sort("order")
          .materialize())
    report.rows = ds.count()
    report.empty_after_truncation = good_rows - report.rows
    if report.rows == 0:
        raise RapidfireError(f"{key} '{path}': no usable rows ({report.rows_read} read, {report.bad_rows} bad"
                             f", {report.empty_after_truncation} with nothing to train on); check data.format "
                             f"('{d.format}') matches the file")
    # (a pair's num_tokens is its padded size in a batch; its real tokens are all trained on)
    sums = rows.column_sums(ds, ["num_tokens", "num_trained", "truncated"])
    report.tokens = sums["num_trained" if d.format == PREFERENCE else "num_tokens"]
    report.trained_tokens = sums["num_trained"]
    report.truncated_rows = sums["truncated"]
    columns = [*PAIR_COLUMNS] if d.format == PREFERENCE else ["input_ids", "loss_mask"]
    ds = ds.select_columns([*columns, "source", "num_tokens"]).materialize()
    return ds, report


def row_lengths(ds) -> np.ndarray:
    """Token count of every row, in dataset order (the order the shards are cut in)."""
    parts = [b["num_tokens"] for b in ds.select_columns(["num_tokens"]).iter_batches(batch_format="numpy",
                                                                                     batch_size=None)]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
