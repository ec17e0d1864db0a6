"""Elastic runs' data position: a stream resumed at another worker count trains every row once
per epoch; position files; the global batch policy."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rapidfire_ray.worker import elastic
from rapidfire_ray.data.elastic import (optimizer_steps, read_position, remainder_shares,
                                        write_position)
from rapidfire_ray.data.loader import DynamicBatches, ShardLoader
from rapidfire_ray.data.sharding import FULL, TRAIN, ExactSplitDataConfig, ShardPlan


def rows(n: int) -> list[dict]:
    return [{"input_ids": np.arange(1, 3 + i % 7, dtype=np.int32), "source": f"f.jsonl:{i + 1}"} for i in range(n)]


def test_remainder_shares_hold_every_row_not_consumed_once_in_contiguous_runs():
    consumed = np.array([0, 3, 4, 9, 10, 11, 20])
    shares = remainder_shares(23, consumed, 3)
    together = np.concatenate(shares)
    assert sorted(together.tolist()) == sorted(set(range(23)) - set(consumed.tolist()))
    assert len(together) == len(set(together.tolist()))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(np.all(np.diff(s) > 0) for s in shares)
    assert all(len(s) == 0 for s in remainder_shares(5, np.array([0, 1, 2, 3]), 2))  # 1 row, 2 workers


def test_position_files_round_trip_and_ranks_in_different_epochs_are_refused(tmp_path):
    assert read_position(str(tmp_path)) is None
    write_position(str(tmp_path), 0, 3, np.array([5, 1, 2]))
    write_position(str(tmp_path), 1, 3, np.array([7, 2]))
    epoch, consumed = read_position(str(tmp_path))
    assert epoch == 3 and consumed.tolist() == [1, 2, 5, 7]
    assert not list(tmp_path.glob("*.tmp*"))
    write_position(str(tmp_path), 2, 4, np.array([9]))
    with pytest.raises(ValueError, match="different epochs"):
        read_position(str(tmp_path))


def test_optimizer_steps_follow_transformers_epoch_chunks():
    assert optimizer_steps(10, 10, 1) == 10
    assert optimizer_steps(10, 4, 3) == 2 + 2 + 1  # chunks 4, 4, 2: each ends its own accumulation group
    assert optimizer_steps(0, 4, 2) == 0


@pytest.mark.parametrize("base, hi, world, want", [(1, 4, 4, 1), (1, 4, 2, 2), (1, 4, 1, 4), (2, 3, 2, 3),
                                                   (1, 3, 2, 2)])
def test_accumulate_keeps_the_global_batch_of_max_workers_to_the_nearest_step(base, hi, world, want):
    assert elastic.accumulation(base, hi, world) == want


def test_adapt_changes_only_the_chosen_knob_and_only_for_elastic_runs():
    cfg = {"scaling": {"num_workers": [1, 4], "elastic": {"batch": "scale_lr"}},
           "train": {"gradient_accumulation_steps": 2}, "optimizer": {"params": {"lr": 1e-3}}}
    out = elastic.adapt(cfg, 2)
    assert out["optimizer"]["params"]["lr"] == pytest.approx(5e-4) and out["train"]["gradient_accumulation_steps"] == 2
    assert cfg["optimizer"]["params"]["lr"] == 1e-3  # a copy
    cfg["scaling"]["elastic"]["batch"] = "accumulate"
    assert elastic.adapt(cfg, 1)["train"]["gradient_accumulation_steps"] == 8
    cfg["scaling"]["num_workers"] = 2
    assert elastic.adapt(cfg, 1) is cfg


def _streams(ray, ds, world, *, batch, epochs, ckpt=None, seed=0, budget=None):
    """Every rank's elastic stream over `ds` for a worker group of `world` workers."""
    parts = ExactSplitDataConfig().configure({TRAIN: ds, FULL: ds}, world, None, None)
    cfg = {"train": {"epochs": epochs, "max_steps": -1}}
    n = ds.count()
    out = []
    for rank in range(world):
        plan = ShardPlan.contiguous(n, world)
        full = ShardLoader(parts[rank][TRAIN], num_rows=n, rank=rank, world_size=world, batch_size=batch, pad_id=0,
                           prefetch_depth=1, seed=seed, with_sources=True, budget=budget,
                           rank_rows=[plan.rows(r) for r in range(world)])
        stream, info = elastic.build_loader(cfg, full, parts[rank][FULL], ckpt, rank=rank, world=world, num_rows=n,
                                            pad_id=0, budget=budget)
        out.append(stream)
    return out


def _pull(streams, steps=None):
    """Batches from every rank in lockstep, as transformers takes them (len() per iter()); returns
    [(epoch, source)] of every row and whether each rank's stream said finished."""
    seen = []
    its = [iter(s) for s in streams]
    taken = 0
    while steps is None or taken < steps:
        got = [next(it, None) for it in its]
        if all(g is None for g in got):
            if all(s.finished for s in streams):
                break
            its = [iter(s) for s in streams]  # transformers' next epoch
            continue
        assert all(g is not None for g in got), "ranks out of lockstep"
        for s, g in zip(streams, got):
            seen += [(s.epoch, src) for src in g["sources"]]
        taken += 1
    return seen


@pytest.mark.parametrize("phases", [[(2, 3), (3, None)], [(3, 2), (1, None)], [(1, 9), (2, None)],
                                    [(2, 4), (2, None)], [(2, 8), (3, None)], [(2, 3), (3, 1), (1, None)],
                                    [(1, 5), (3, 2), (2, 3), (1, None)]])
@pytest.mark.parametrize("strategy", ["fixed", "token_budget"])
def test_a_stream_resumed_at_other_worker_counts_trains_every_row_once_per_epoch(ray_cluster, tmp_path, phases,
                                                                                 strategy):
    """Worker groups of (workers, steps until their last checkpoint): each trains one more step
    after it (lost with the group), the next resumes from the checkpoint's position files. With
    fixed batches and with token_budget batches (planned again over each group's rows)."""
    n, batch, epochs = 23, 2, 2
    ds = ray_cluster.data.from_items(rows(n)).materialize()
    budget = None
    if strategy == "token_budget":
        lengths = [len(r["input_ids"]) for r in rows(n)]
        budget = DynamicBatches.token_budget({"data": {"dynamic_batch": {"max_tokens": 16, "max": None, "window": 8,
                                                                         "max_padding": 1.0}, "max_length": 8},
                                              "train": {"per_device_batch_size": batch}}, lengths)
    seen, ckpt = [], None
    for i, (world, steps) in enumerate(phases):
        streams = _streams(ray_cluster, ds, world, batch=batch, epochs=epochs, ckpt=ckpt, budget=budget)
        seen += _pull(streams, steps)
        if steps is None:
            assert all(s.finished for s in streams)
            break
        ckpt = tmp_path / f"checkpoint-{i}"
        ckpt.mkdir()
        ckpt = str(ckpt)
        for rank, s in enumerate(streams):
            write_position(ckpt, rank, *s.position())
        assert _pull(streams, 1)  # a step after the checkpoint, lost with the worker group
    per_epoch = Counter(epoch for epoch, _ in seen)
    assert per_epoch == {0: n, 1: n}, per_epoch
    for epoch in range(epochs):
        assert Counter(src for e, src in seen if e == epoch) == Counter(r["source"] for r in rows(n))


def test_a_checkpoint_without_a_data_position_is_refused_with_the_fix(ray_cluster, tmp_path):
    ds = ray_cluster.data.from_items(rows(6)).materialize()
    (tmp_path / "checkpoint-00000004").mkdir()
    with pytest.raises(Exception, match="no data position .* fixed scaling.num_workers"):
        _streams(ray_cluster, ds, 2, batch=2, epochs=1, ckpt=str(tmp_path / "checkpoint-00000004"))


def test_scale_lr_sets_this_worker_counts_rate_again_after_a_resume_restored_another():
    """A resume loads the optimizer and scheduler saved by a group of another size: their learning
    rate is that group's. ScaledLR puts this group's back, at the schedule's current point."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    def make(lr):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.AdamW([p], lr=lr)
        return opt, get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=10)

    opt, sched = make(1e-3)  # saved by 2 of 2 workers: lr 1e-3
    for _ in range(4):
        opt.step()
        sched.step()
    saved = opt.state_dict(), sched.state_dict()
    opt, sched = make(5e-4)  # resumed on 1 of 2 workers: 5e-4
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 6 / 10)  # the saved group's rate came back
    elastic.ScaledLR(5e-4).on_train_begin(None, None, None, optimizer=opt, lr_scheduler=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4 * 6 / 10)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4 * 5 / 10)
