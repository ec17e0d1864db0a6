"""Dynamic batching (token budget, memory budget) that keeps ranks in lockstep.

A rank's rows are taken in windows of `window` rows (in shard order); inside a window they are
sorted by length and cut greedily so that a batch holds at most `rows_fit(width)` rows at its
padded width (`token_budget`: rows x width within `max_tokens`, at most `max_rows` rows;
`memory_aware`: what the memory model says fits, clamped to [min, max]), and padding stays within
`max_padding` of the batch's tokens (without that cap, a large budget filled with short rows of slowly growing
length still pads 10-20%). Every rank must run the same number of
steps per epoch or collectives hang, so ranks with fewer batches split their largest batches
until all have as many as the rank with the most (`lockstep`). The plan depends only on the
rows' lengths, so it is the same every epoch; each epoch only reorders the batches inside a
window.
"""
from __future__ import annotations

import bisect
from typing import Callable

import numpy as np


RowsFit = Callable[[int], int]  # padded width -> the most rows a batch of that width may hold


def token_budget_rows(max_tokens: int, max_rows: int | None) -> RowsFit:
    """`token_budget`: rows x width within `max_tokens`, at most `max_rows` rows."""
    def rows_fit(width: int) -> int:
        if width > max_tokens:
            raise ValueError(f"a row of {width} tokens exceeds the token budget of {max_tokens}")
        rows = max_tokens // width
        return rows if max_rows is None else min(rows, max_rows)
    return rows_fit


def cut_batches(lengths: np.ndarray, rows_fit: RowsFit, window: int, max_padding: float = 1.0,
                min_rows: int = 1) -> list[list[int]]:
    """Batches of local row indices (each list sorted by length), window by window.

    A batch grows (shortest rows first) while `rows_fit(longest row)` allows one more row and its
    padding stays within `max_padding`; it is never cut below `min_rows` rows, and a window's last
    batch, when shorter than `min_rows`, is merged into the one before (the pair split in two if
    that is too large). So every batch holds at least `min_rows` rows when the window has them and
    the cap allows it (cap >= 2 x min_rows - 1); the cap always holds."""
    batches: list[list[int]] = []
    for start, end in window_bounds(len(lengths), window, min_rows):
        idx = start + np.argsort(lengths[start:end], kind="stable")
        in_window: list[list[int]] = []
        batch: list[int] = []
        real = 0  # real tokens in the batch; rows come shortest first, so the newest is the longest
        for i in idx.tolist():
            n = int(lengths[i])
            cap = rows_fit(n)
            padded = (len(batch) + 1) * n
            fits = len(batch) < cap and padded - (real + n) <= max_padding * padded
            if batch and not fits and len(batch) >= min_rows:
                in_window.append(batch)
                batch, real = [], 0
            batch.append(i)
            real += n
        if batch:
            in_window.append(batch)
        if len(in_window) > 1 and len(in_window[-1]) < min_rows:
            merged = in_window[-2] + in_window[-1]
            half = len(merged) // 2
            if len(merged) <= rows_fit(int(lengths[merged[-1]])):
                in_window[-2:] = [merged]
            elif half >= min_rows:
                in_window[-2:] = [merged[:half], merged[half:]]
            # else: only a batch above the cap could hold them (max < 2 x min - 1); the cap wins.
        batches += in_window
    return batches


def token_budget_batches(lengths: np.ndarray, max_tokens: int, max_rows: int | None, window: int,
                         max_padding: float = 1.0) -> list[list[int]]:
    return cut_batches(lengths, token_budget_rows(max_tokens, max_rows), window, max_padding)


def lockstep(plans: list[list[list[int]]], min_rows: int = 1) -> list[list[list[int]]]:
    """Split the largest batches of each rank until every rank has the same number of batches
    (never into halves below `min_rows`)."""
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
            if half < min_rows:
                raise ValueError(f"rank {rank} cannot be cut into the {target} batches per epoch the other ranks "
                                 f"need without batches below data.dynamic_batch.min ({min_rows} rows); lower it, "
                                 "or use fewer workers")
            plan[k:k + 1] = [big[:half], big[half:]]  # both halves stay in the same window
        out.append(plan)
    return out


def window_bounds(num_rows: int, window: int, min_rows: int = 1) -> list[tuple[int, int]]:
    """[start, end) of each window of a shard; a last remainder shorter than `min_rows` joins
    the window before it (so it is not left as a batch below the minimum)."""
    bounds = [(s, min(s + window, num_rows)) for s in range(0, num_rows, window)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_rows:
        bounds[-2:] = [(bounds[-2][0], num_rows)]
    return bounds


def window_of(batch: list[int], bounds: list[tuple[int, int]]) -> int:
    """Index of the window holding the batch (its rows are all in one window)."""
    return bisect.bisect_right([s for s, _ in bounds], batch[0]) - 1
