"""Token-budget batching that keeps ranks in lockstep.

A rank's rows are taken in windows of `window` rows (in shard order); inside a window they are
sorted by length and cut greedily so that padded tokens (rows x longest row) stay within
`max_tokens`, with at most `max_rows` rows per batch, and padding stays within `max_padding` of
the batch's tokens (without that cap, a large budget filled with short rows of slowly growing
length still pads 10-20%). Every rank must run the same number of
steps per epoch or collectives hang, so ranks with fewer batches split their largest batches
until all have as many as the rank with the most (`lockstep`). The plan depends only on the
rows' lengths, so it is the same every epoch; each epoch only reorders the batches inside a
window.
"""
from __future__ import annotations

import numpy as np


def token_budget_batches(lengths: np.ndarray, max_tokens: int, max_rows: int | None, window: int,
                         max_padding: float = 1.0) -> list[list[int]]:
    """Batches of local row indices (each list sorted by length), window by window."""
    batches: list[list[int]] = []
    for start in range(0, len(lengths), window):
        idx = start + np.argsort(lengths[start:start + window], kind="stable")
        batch: list[int] = []
        real = 0  # real tokens in the batch; rows come shortest first, so the newest is the longest
        for i in idx.tolist():
            n = int(lengths[i])
            if n > max_tokens:
                raise ValueError(f"a row of {n} tokens exceeds the token budget of {max_tokens}")
            padded = (len(batch) + 1) * n
            fits = (padded <= max_tokens and (max_rows is None or len(batch) < max_rows)
                    and padded - (real + n) <= max_padding * padded)
            if batch and not fits:
                batches.append(batch)
                batch, real = [], 0
            batch.append(i)
            real += n
        if batch:
            batches.append(batch)
    return batches


def lockstep(plans: list[list[list[int]]]) -> list[list[list[int]]]:
    """Split the largest batches of each rank until every rank has the same number of batches."""
    target = max(len(p) for p in plans)
    out = []
    for rank, plan in enumerate(plans):
        plan = [list(b) for b in plan]
        rows = sum(len(b) for b in plan)
        if rows < target:
            raise ValueError(f"rank {rank} has {rows} rows but the other ranks need {target} steps per epoch; "
                             "raise data.dynamic_batch.max_tokens or use fewer workers")
        while len(plan) < target:
            k = max(range(len(plan)), key=lambda j: len(plan[j]))
            big = plan[k]
            half = len(big) // 2
            plan[k:k + 1] = [big[:half], big[half:]]  # both halves stay in the same window
        out.append(plan)
    return out


def window_of(batch: list[int], window: int) -> int:
    return batch[0] // window
