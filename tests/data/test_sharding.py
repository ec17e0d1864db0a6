"""ShardPlan (every row once, sizes as shard_bounds, node locality, determinism, json) and
ExactSplitDataConfig realising a plan exactly (resume) and publishing it on the progress board."""
from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest

from rapidfire_ray.data.sharding import (
    TRAIN,
    ExactSplitDataConfig,
    ShardPlan,
    block_layout,
    shard_bounds,
)


def layout(sizes, nodes):
    """Blocks of the given row counts on the given nodes, tiling [0, sum(sizes))."""
    ends = np.cumsum([0, *sizes]).tolist()
    return [(ends[i], ends[i + 1], node) for i, node in enumerate(nodes)]


def best_local(blocks, worker_nodes, num_rows) -> int:
    """The most rows any plan with shard_bounds sizes can read on the node holding them."""
    quota = [e - s for s, e in shard_bounds(num_rows, len(worker_nodes))]
    held = {}
    for s, e, node in blocks:
        held[node] = held.get(node, 0) + e - s
    return sum(min(held.get(node, 0), sum(q for q, w in zip(quota, worker_nodes) if w == node))
               for node in set(worker_nodes))


def check(plan: ShardPlan, num_rows: int, world: int) -> None:
    assert plan.world_size == world and plan.num_rows == num_rows
    assert plan.sizes() == [e - s for s, e in shard_bounds(num_rows, world)]
    rows = np.concatenate([plan.rows(r) for r in range(world)])
    assert sorted(rows.tolist()) == list(range(num_rows))  # every row exactly once
    for r in range(world):
        assert len(plan.rows(r)) == plan.sizes()[r]
        assert list(plan.ranges[r]) == sorted(plan.ranges[r])  # read in global order
        assert all(e0 < s1 for (_, e0), (s1, _) in itertools.pairwise(plan.ranges[r]))  # joined


def random_cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        world = int(rng.integers(1, 6))
        num_rows = int(rng.integers(world, 120))
        cuts = sorted(set(rng.integers(1, max(num_rows, 2), size=int(rng.integers(0, 12))).tolist()) - {num_rows})
        sizes = np.diff([0, *cuts, num_rows]).tolist()
        node_pool = ["a", "b", "c"][:int(rng.integers(1, 4))]
        nodes = [None if rng.random() < 0.15 else str(rng.choice(node_pool)) for _ in sizes]
        workers = [str(rng.choice(node_pool)) for _ in range(world)]
        yield num_rows, layout(sizes, nodes), workers


@pytest.mark.parametrize("seed", range(4))
def test_by_node_uses_every_row_once_with_shard_bounds_sizes_and_maximal_locality(seed):
    for num_rows, blocks, workers in random_cases(seed, 150):
        plan = ShardPlan.by_node(blocks, workers, num_rows)
        check(plan, num_rows, len(workers))
        assert round(plan.local_fraction(blocks, workers) * num_rows) == best_local(blocks, workers, num_rows)
        assert ShardPlan.by_node(blocks, workers, num_rows) == plan  # deterministic


@pytest.mark.parametrize("num_rows, world", [(1, 1), (2, 2), (7, 3), (10, 2), (11, 2), (12, 3), (1000, 7), (3, 5)])
def test_contiguous_is_shard_bounds(num_rows, world):
    plan = ShardPlan.contiguous(num_rows, world)
    assert [r[0] if r else None for r in plan.ranges] == [b if b[1] > b[0] else None
                                                         for b in shard_bounds(num_rows, world)]
    assert plan.sizes() == [e - s for s, e in shard_bounds(num_rows, world)]
    if num_rows >= world:
        check(plan, num_rows, world)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("num_rows", [3, 10, 11, 100, 101])
def test_exhaustive_small_layouts_one_to_three_workers(world, num_rows):
    if num_rows < world:
        return
    sizes = [num_rows // 4, num_rows // 4, num_rows - 2 * (num_rows // 4)]
    sizes = [s for s in sizes if s > 0]
    for nodes in itertools.product(["a", "b", None], repeat=len(sizes)):
        for workers in itertools.product(["a", "b"], repeat=world):
            blocks = layout(sizes, nodes)
            plan = ShardPlan.by_node(blocks, list(workers), num_rows)
            check(plan, num_rows, world)
            assert round(plan.local_fraction(blocks, workers) * num_rows) == best_local(blocks, workers, num_rows)


def test_two_nodes_each_holding_half_the_blocks_read_everything_locally():
    blocks = layout([10] * 8, ["a", "b"] * 4)  # interleaved: contiguous shards would be half local
    plan = ShardPlan.by_node(blocks, ["a", "b"], 80)
    assert plan.local_fraction(blocks, ["a", "b"]) == 1.0
    assert ShardPlan.contiguous(80, 2).local_fraction(blocks, ["a", "b"]) == 0.5
    assert plan.ranges == (((0, 10), (20, 30), (40, 50), (60, 70)), ((10, 20), (30, 40), (50, 60), (70, 80)))
    # Two workers per node, uneven blocks: still all local, sizes 20 each.
    blocks = layout([15, 25, 25, 15], ["a", "b", "a", "b"])
    plan = ShardPlan.by_node(blocks, ["a", "a", "b", "b"], 80)
    check(plan, 80, 4)
    assert plan.local_fraction(blocks, ["a", "a", "b", "b"]) == 1.0


def test_surplus_is_cut_and_given_to_the_rank_short_of_rows():
    blocks = layout([30, 30, 40], ["a", "a", "b"])  # node a holds 60 rows, its rank needs 50
    plan = ShardPlan.by_node(blocks, ["a", "b"], 100)
    assert plan.ranges == (((0, 50),), ((50, 100),))
    assert plan.local_fraction(blocks, ["a", "b"]) == 0.9


def test_blocks_with_no_node_or_one_node_give_the_contiguous_plan():
    blocks = layout([5, 7, 3, 9], [None] * 4)
    assert ShardPlan.by_node(blocks, ["a", "b", "c"], 24) == ShardPlan.contiguous(24, 3)
    blocks = layout([5, 7, 3, 9], ["a"] * 4)
    assert ShardPlan.by_node(blocks, ["a", "a", "a"], 24) == ShardPlan.contiguous(24, 3)


def test_rows_json_round_trip_and_validation():
    plan = ShardPlan.by_node(layout([4, 4, 4], ["b", "a", "b"]), ["a", "b"], 12)
    assert plan.rows(0).tolist() == [4, 5, 6, 7, 10, 11] and plan.rows(1).tolist() == [0, 1, 2, 3, 8, 9]
    again = ShardPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.fits(12, 2) and not again.fits(12, 3) and not again.fits(13, 2)
    assert not ShardPlan(12, (((0, 2),), ((2, 12),))).fits(12, 2)  # sizes unlike shard_bounds
    with pytest.raises(ValueError, match="exactly once"):
        ShardPlan(10, (((0, 6),), ((5, 10),)))  # overlap
    with pytest.raises(ValueError, match="exactly once"):
        ShardPlan(10, (((0, 4),), ((5, 10),)))  # gap
    with pytest.raises(ValueError, match="covers 8 rows"):
        ShardPlan(10, (((0, 4),), ((4, 8),)))
    with pytest.raises(ValueError, match="tile"):
        ShardPlan.by_node([(0, 4, "a"), (5, 10, "b")], ["a", "b"], 10)


# ---- on the shared single-node Ray session ----

def id_shards(its) -> list[list[int]]:
    return [[int(i) for b in it.iter_batches(batch_size=7, batch_format="numpy") for i in b["id"]] for it in its]


def configure(ds, world, **kwargs):
    config = ExactSplitDataConfig(**kwargs)
    its = [out[TRAIN] for out in config.configure({TRAIN: ds}, world, None, None)]
    return config, its


def test_saved_plan_is_realised_exactly_in_plan_order(ray_cluster):
    ds = ray_cluster.data.range(100, override_num_blocks=6).materialize()  # blocks of ~17 rows
    order = [int(i) for b in ds.iter_batches(batch_format="numpy") for i in b["id"]]
    # A fragmented plan whose cuts fall inside blocks (fake node layout of blocks of 10).
    plan = ShardPlan.by_node(layout([10] * 10, ["a", "b", "c", "a", "b", "c", "c", "a", "b", "a"]),
                             ["a", "b", "c"], 100)
    assert all(len(r) > 1 for r in plan.ranges)
    config, its = configure(ds, 3, saved_plan=plan.to_json())
    assert config.plan == plan
    for _ in range(2):  # the same every epoch
        assert id_shards(its) == [[order[g] for g in plan.rows(r)] for r in range(3)]


def test_a_plan_that_does_not_fit_is_not_reused_and_one_node_gives_contiguous_shards(ray_cluster):
    ds = ray_cluster.data.range(30, override_num_blocks=3).materialize()
    order = [int(i) for b in ds.iter_batches(batch_format="numpy") for i in b["id"]]
    stale = ShardPlan.contiguous(30, 2).to_json()
    config = ExactSplitDataConfig(saved_plan=stale)
    its = [out[TRAIN] for out in config.configure({TRAIN: ds}, 3, None, ["n1", "n1", "n1"])]
    assert config.plan == ShardPlan.contiguous(30, 3)
    assert id_shards(its) == [order[s:e] for s, e in shard_bounds(30, 3)]


def test_more_workers_than_rows_get_empty_shards(ray_cluster):
    ds = ray_cluster.data.range(2).materialize()
    config, its = configure(ds, 3)
    assert sorted(i for shard in id_shards(its) for i in shard) == [0, 1] and config.plan.sizes() == [0, 1, 1]


def test_plan_is_published_on_the_board_and_reused_by_a_later_worker_group(ray_cluster):
    from rapidfire_ray.telemetry.board import RunBoard

    board = RunBoard.remote()
    try:
        ds = ray_cluster.data.range(40, override_num_blocks=4).materialize()
        # The config travels to Ray Train's DatasetManager actor by deepcopy + pickle.
        config = copy.deepcopy(ExactSplitDataConfig(board=board))
        config.configure({TRAIN: ds}, 2, None, None)
        assert ray_cluster.get(board.shard_plan.remote()) == ShardPlan.contiguous(40, 2).to_json()
        # A restarted worker group of the same run (a fresh config) keeps the published plan,
        # even where it would now compute another one.
        odd = ShardPlan(40, (((0, 10), (30, 40)), ((10, 30),)))
        ray_cluster.get(board.publish_shard_plan.remote(odd.to_json()))
        config = ExactSplitDataConfig(board=board)
        its = [out[TRAIN] for out in config.configure({TRAIN: ds}, 2, None, None)]
        assert config.plan == odd
        order = [int(i) for b in ds.iter_batches(batch_format="numpy") for i in b["id"]]
        assert id_shards(its) == [[order[g] for g in odd.rows(r)] for r in range(2)]
    finally:
        ray_cluster.kill(board)


def test_block_layout_tiles_the_dataset(ray_cluster):
    ds = ray_cluster.data.range(50, override_num_blocks=4).materialize()
    blocks = block_layout(ds, ["x"])
    assert blocks[0][0] == 0 and blocks[-1][1] == 50
    assert all(e0 == s1 for (_, e0, _), (s1, _, _) in itertools.pairwise(blocks))
