"""Token-budget batching: budget held, every row once, ranks in lockstep even with skewed lengths."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rapidfire_ray.data.batching import (cut_batches, lockstep, token_budget_batches, token_budget_rows, window_bounds,
                                         window_of)
from rapidfire_ray.data.loader import DynamicBatches, ShardLoader
from rapidfire_ray.data.sharding import TRAIN, ExactSplitDataConfig
from loader_checks import epoch_sources


def long_tailed(n: int, seed: int = 0, cap: int = 256) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(3.5, 0.9, n).astype(int), 4, cap)


@pytest.mark.parametrize("max_tokens, max_rows, window, max_padding",
                         [(512, None, 64, 1.0), (256, 8, 1000, 0.05), (300, 3, 7, 0.2), (2048, None, 500, 0.0)])
def test_budget_is_never_exceeded_and_every_row_is_used_once(max_tokens, max_rows, window, max_padding):
    lengths = long_tailed(500)
    batches = token_budget_batches(lengths, max_tokens, max_rows, window, max_padding)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        padded = len(b) * lengths[b].max()
        assert padded <= max_tokens
        assert padded - lengths[b].sum() <= max_padding * padded
        assert max_rows is None or len(b) <= max_rows
        bounds = window_bounds(len(lengths), window)
        assert len({window_of([i], bounds) for i in b}) == 1  # a batch never spans windows


def test_row_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="row of 300 tokens exceeds the token budget of 256"):
        token_budget_batches(np.array([10, 300]), 256, None, 10)


def test_lockstep_equalises_skewed_ranks_within_budget():
    short, long_ = np.full(100, 10), np.full(100, 200)  # rank 0 all short rows, rank 1 all long rows
    plans = [token_budget_batches(x, 400, None, 50) for x in (short, long_)]
    assert len(plans[0]) < len(plans[1])
    even = lockstep(plans)
    assert len(even[0]) == len(even[1]) == len(plans[1])
    for lengths, plan in zip((short, long_), even):
        assert sorted(i for b in plan for i in b) == list(range(100))
        assert all(len(b) * lengths[b].max() <= 400 for b in plan)


def test_lockstep_impossible_is_a_clear_error():
    with pytest.raises(ValueError, match="rank 0 has 2 rows but the other ranks need 3 steps"):
        lockstep([[[0, 1]], [[0], [1], [2]]])


def padded_fraction(batches) -> float:
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    return 1 - real / sum(b["attention_mask"].numel() for b in batches)


def make_rows(lengths):
    return [{"input_ids": np.arange(1, n + 1, dtype=np.int32), "loss_mask": np.ones(n, np.int8),
             "source": f"s:{i}", "num_tokens": int(n)} for i, n in enumerate(lengths)]


def test_token_budget_loaders_in_lockstep_exact_and_resumable(ray_cluster):
    # Skewed per rank: the first half of the rows (rank 0) is short, the second half long.
    lengths = np.concatenate([long_tailed(150, 1, cap=40), long_tailed(151, 2, cap=256) + 40])
    ds = ray_cluster.data.from_items(make_rows(lengths)).materialize()
    budget = DynamicBatches(lengths=lengths, rows_fit=token_budget_rows(512, None), window=64)

    def loaders():
        its = [i[TRAIN] for i in ExactSplitDataConfig().configure({TRAIN: ds}, 2, None, None)]
        return [ShardLoader(it, num_rows=len(lengths), rank=r, world_size=2, batch_size=4, pad_id=0, seed=5,
                            with_sources=True, budget=budget) for r, it in enumerate(its)]

    first = loaders()
    assert len(first[0]) == len(first[1])
    for epoch in range(2):
        assert epoch_sources(first, epoch, max_padded=512) == Counter(f"s:{i}" for i in range(len(lengths)))
    # A resumed loader skips exactly the batches already trained on in that epoch.
    again = loaders()[1]
    again.set_epoch(1)
    order = [b["sources"] for b in again]
    again.set_epoch(1)
    again.skip_next(5)
    assert [b["sources"] for b in again] == order[5:]


def test_token_budget_pads_far_less_than_fixed_batches(ray_cluster):
    lengths = long_tailed(400, 3)
    ds = ray_cluster.data.from_items(make_rows(lengths)).materialize()
    [it] = [i[TRAIN] for i in ExactSplitDataConfig().configure({TRAIN: ds}, 1, None, None)]
    fixed = list(ShardLoader(it, num_rows=400, rank=0, world_size=1, batch_size=8, pad_id=0))
    budget = DynamicBatches(lengths=lengths, rows_fit=token_budget_rows(8 * 256, None), window=400, max_padding=0.05)
    dynamic = list(ShardLoader(it, num_rows=400, rank=0, world_size=1, batch_size=8, pad_id=0, budget=budget))
    assert padded_fraction(dynamic) < 0.05 < padded_fraction(fixed)


def memory_like_rows(lo: int, hi: int):
    """A stand-in for the memory model's rule: fewer rows at longer widths (with a quadratic
    term, like attention), clamped to [lo, hi]."""
    return lambda width: max(lo, min(hi, 60_000 // (width * (1 + width // 64)))) if hi else 0


@pytest.mark.parametrize("lo, hi, window", [(1, 32, 128), (2, 12, 64), (4, 16, 500), (3, 8, 50)])
def test_memory_style_batches_stay_within_min_and_max_and_use_every_row_once(lo, hi, window):
    rows_fit = memory_like_rows(lo, hi)
    # Skewed per rank: rank 0 short rows, rank 1 long rows, rank 2 mixed.
    ranks = [long_tailed(300, 1, cap=40), long_tailed(301, 2, cap=256) + 40, long_tailed(299, 3)]
    plans = lockstep([cut_batches(x, rows_fit, window, 0.2, lo) for x in ranks], lo)
    assert len({len(p) for p in plans}) == 1
    for lengths, plan in zip(ranks, plans):
        assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
        bounds = window_bounds(len(lengths), window, lo)
        for b in plan:
            assert lo <= len(b) <= hi
            assert len({window_of([i], bounds) for i in b}) == 1


def test_a_short_window_tail_is_merged_to_respect_min():
    # 5 rows fit, min 3: 5 + 5 + 1 -> the tail joins the batch before it, split in two: 5 + 3 + 3.
    batches = cut_batches(np.array([10] * 11), lambda w: 5, window=11, min_rows=3)
    assert [len(b) for b in batches] == [5, 3, 3]
    assert sorted(i for b in batches for i in b) == list(range(11))
    # A last window shorter than min joins the window before it.
    assert window_bounds(102, 50, 3) == [(0, 50), (50, 102)]
    assert window_bounds(103, 50, 3) == [(0, 50), (50, 100), (100, 103)]


def test_when_min_equals_max_the_cap_wins_over_min_for_a_window_tail():
    batches = cut_batches(np.array([10] * 7), lambda w: 3, window=7, min_rows=3)
    assert [len(b) for b in batches] == [3, 3, 1]


def test_lockstep_refuses_to_split_below_min():
    with pytest.raises(ValueError, match="without batches below data.dynamic_batch.min \\(3 rows\\)"):
        lockstep([[[0, 1, 2, 3, 4]], [[0, 1, 2], [3, 4, 5]]], min_rows=3)
