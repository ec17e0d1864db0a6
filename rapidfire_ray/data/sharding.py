"""Exact, deterministic, node-local sharding of the training dataset across Ray Train workers.

Ray's default `streaming_split(equal=True)` drops up to `world_size - 1` rows per epoch and
assigns rows to ranks in arrival order, so neither "every row once" nor a deterministic resume
holds. `ExactSplitDataConfig` instead gives every rank a fixed `ShardPlan`: per rank, an ordered
list of [start, end) ranges of global row indices (the order of the materialised dataset).

- Every row belongs to exactly one rank, and rank r holds exactly as many rows as
  `shard_bounds(num_rows, world_size)[r]` (sizes differ by at most one), so `ShardLoader` can
  keep the ranks in lockstep from `num_rows` alone.
- `data.shard_by_node: true` (the default): when the workers span more than one node, the plan is
  built by `ShardPlan.by_node` from where the materialised blocks live (`block_layout`), so a rank
  reads the blocks held by its own node's object store where it can (greedy, and maximal: every
  node gets min(rows it holds, rows its ranks need) local rows). Otherwise (one node, blocks with
  no node, or `shard_by_node: false`) the plan is `ShardPlan.contiguous`: rank r reads the r-th
  contiguous slice.
- Resume: the plan is published on the run's progress board (`"shard_plan"`), the driver stores it
  with the checkpoints and hands it back as `saved_plan`; a saved (or already published) plan that
  fits the dataset and the world size is reused as is, so a resumed run reads exactly the same
  rows in the same order on every rank, whatever the blocks' locations are by then.

A plan is realised (`realise`) with `Dataset.split_at_indices` at every range boundary (blocks
that need no cut keep their object and therefore their node) and, per rank, its pieces'
blocks concatenated in plan order (not `Dataset.union`, which interleaves), read with
`preserve_order`.
"""
from __future__ import annotations

import logging
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ray.train import DataConfig

TRAIN = "train"
FULL = "train_full"  # elastic runs: the whole training dataset too, for the rest of an epoch after a resize

logger = logging.getLogger(__name__)

Range = tuple[int, int]
Block = tuple[int, int, str | None]  # [start, end) global rows of one block, node holding it (None: unknown)


def shard_bounds(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) row ranges, one per rank, covering every row once; sizes differ by <= 1."""
    return [(r * num_rows // world_size, (r + 1) * num_rows // world_size) for r in range(world_size)]


def _merged(ranges: Sequence[Range]) -> tuple[Range, ...]:
    """Non-empty ranges sorted by start, touching ones joined."""
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e])
    return tuple((s, e) for s, e in out)


def _check_blocks(blocks: Sequence[Block], num_rows: int) -> None:
    pos = 0
    for s, e, _ in blocks:
        if s != pos or e < s:
            raise ValueError(f"blocks must tile [0, {num_rows}) in order; got [{s}, {e}) at row {pos}")
        pos = e
    if pos != num_rows:
        raise ValueError(f"blocks cover {pos} rows, the dataset has {num_rows}")


@dataclass(frozen=True)
class ShardPlan:
    """Which global rows each rank reads, in which order: `ranges[rank]` is that rank's ordered
    [start, end) ranges. Checked on construction: every row of [0, num_rows) exactly once."""

    num_rows: int
    ranges: tuple[tuple[Range, ...], ...]

    def __post_init__(self):
        ranges = tuple(tuple((int(s), int(e)) for s, e in rank) for rank in self.ranges)
        object.__setattr__(self, "ranges", ranges)
        if not ranges:
            raise ValueError("a shard plan needs at least one rank")
        pos = 0
        for s, e in sorted(r for rank in ranges for r in rank):
            if s != pos or e <= s:
                raise ValueError(f"shard plan ranges must cover [0, {self.num_rows}) exactly once with non-empty "
                                 f"ranges; got [{s}, {e}) at row {pos}")
            pos = e
        if pos != self.num_rows:
            raise ValueError(f"shard plan covers {pos} rows, not {self.num_rows}")

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def sizes(self) -> list[int]:
        return [sum(e - s for s, e in rank) for rank in self.ranges]

    def rows(self, rank: int) -> np.ndarray:
        """Global indices of `rank`'s rows, in the order its shard yields them."""
        parts = [np.arange(s, e, dtype=np.int64) for s, e in self.ranges[rank]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def fits(self, num_rows: int, world_size: int) -> bool:
        """Usable for this dataset size and world size (sizes as `shard_bounds`, which the loader assumes)."""
        return (self.num_rows == num_rows and self.world_size == world_size
                and self.sizes() == [e - s for s, e in shard_bounds(num_rows, world_size)])

    def to_json(self) -> dict:
        return {"num_rows": self.num_rows, "ranges": [[[s, e] for s, e in rank] for rank in self.ranges]}

    @classmethod
    def from_json(cls, d: dict) -> ShardPlan:
        return cls(num_rows=int(d["num_rows"]), ranges=tuple(tuple((s, e) for s, e in rank) for rank in d["ranges"]))

    @classmethod
    def contiguous(cls, num_rows: int, world_size: int) -> ShardPlan:
        """Rank r reads the r-th contiguous slice (`shard_bounds`)."""
        return cls(num_rows, tuple(_merged([b]) for b in shard_bounds(num_rows, world_size)))

    @classmethod
    def by_node(cls, blocks: Sequence[Block], worker_node_ids: Sequence[str | None], num_rows: int) -> ShardPlan:
        """Sizes as `contiguous`, with as many rows as possible read from blocks on the rank's own node.

        `blocks`: (start, end, node or None) for the materialised blocks, tiling [0, num_rows) in
        order. Greedy: node by node (in order of first appearance in `worker_node_ids`), the
        node's ranks, in rank order, take the node's blocks in global order up to their quota
        (a block is cut where a quota ends); then what is left (blocks on no worker's node,
        nodes' surplus) goes, in global order, to the ranks still short. Each rank's ranges are
        sorted by start and joined, so its shard reads in global order. Deterministic."""
        _check_blocks(blocks, num_rows)
        world_size = len(worker_node_ids)
        quota = [e - s for s, e in shard_bounds(num_rows, world_size)]
        ranks_of: dict[str, list[int]] = {}
        for rank, node in enumerate(worker_node_ids):
            if node is not None:
                ranks_of.setdefault(node, []).append(rank)
        local: dict[str, list[Range]] = defaultdict(list)
        for s, e, node in blocks:
            if e > s and node in ranks_of:
                local[node].append((s, e))
        taken: list[list[Range]] = [[] for _ in range(world_size)]
        leftover: list[Range] = [(s, e) for s, e, node in blocks if e > s and node not in ranks_of]
        for node, ranks in ranks_of.items():
            leftover.extend(_fill(local[node], ranks, quota, taken))
        leftover.sort()
        rest = _fill(leftover, range(world_size), quota, taken)
        assert not rest and not any(quota), "by_node: rows left over or ranks short"  # sizes add up to num_rows
        return cls(num_rows, tuple(_merged(t) for t in taken))

    def local_fraction(self, blocks: Sequence[Block], worker_node_ids: Sequence[str | None]) -> float:
        """Share of all rows assigned to a rank on the node holding their block (rows on no known
        node count as not local)."""
        _check_blocks(blocks, self.num_rows)
        if self.num_rows == 0:
            return 1.0
        starts = [s for s, _, _ in blocks]
        local = 0
        for rank, ranges in enumerate(self.ranges):
            node = worker_node_ids[rank]
            if node is None:
                continue
            for s, e in ranges:
                i = bisect_right(starts, s) - 1
                while i < len(blocks) and blocks[i][0] < e:
                    bs, be, bnode = blocks[i]
                    if bnode == node:
                        local += max(0, min(e, be) - max(s, bs))
                    i += 1
        return local / self.num_rows


def _fill(ranges: Sequence[Range], ranks: Sequence[int], quota: list[int], taken: list[list[Range]]) -> list[Range]:
    """Hand `ranges` (in order) to `ranks` (in order) until their `quota` is met, cutting a range
    where a quota ends; updates `quota`/`taken`; returns what nobody took."""
    ranks = [r for r in ranks if quota[r] > 0]
    left: list[Range] = []
    i = 0
    for s, e in ranges:
        while s < e and i < len(ranks):
            r = ranks[i]
            n = min(quota[r], e - s)
            taken[r].append((s, s + n))
            quota[r] -= n
            s += n
            if quota[r] == 0:
                i += 1
        if s < e:
            left.append((s, e))
    return left


def block_layout(ds, worker_node_ids: Sequence[str | None] = (), timeout_s: float = 30.0) -> list[Block]:
    """(start, end, node) of a materialised dataset's blocks, in dataset order.

    Row counts come from the blocks' metadata (`Dataset.iter_internal_ref_bundles`, a Ray Data
    developer API), locations from `ray.experimental.get_object_locations`. A block with no
    location (small ones live in the owner's memory, not in a node's object store) gets None; a
    block copied to several nodes is credited to one of them that hosts workers, the one with
    the least rows credited per worker so far."""
    import ray.experimental

    entries = []  # (ref, rows)
    for bundle in ds.iter_internal_ref_bundles():
        for entry, piece in zip(bundle.blocks, bundle.slices):
            rows = piece.num_rows if piece is not None else entry.metadata.num_rows
            if rows is None:
                raise ValueError("a block's row count is unknown")
            entries.append((entry.ref, rows))
    refs = [ref for ref, _ in entries]
    locations = ray.experimental.get_object_locations(refs, timeout_ms=int(timeout_s * 1000)) if refs else {}
    workers = defaultdict(int)
    for node in worker_node_ids:
        if node is not None:
            workers[node] += 1
    credited: dict[str, int] = defaultdict(int)
    blocks: list[Block] = []
    pos = 0
    for ref, rows in entries:
        nodes = sorted(set((locations.get(ref) or {}).get("node_ids") or []))
        hosting = [n for n in nodes if n in workers]
        node = (min(hosting, key=lambda n: (credited[n] / workers[n], n)) if hosting
                else (nodes[0] if nodes else None))
        if node is not None:
            credited[node] += rows
        blocks.append((pos, pos + rows, node))
        pos += rows
    return blocks


class ExactSplitDataConfig(DataConfig):
    """Split the `train` dataset into the exact shards of a `ShardPlan`; other datasets (`train_full`
    of an elastic run) go whole to each worker, in dataset order.

    `shard_by_node`: build the plan from the blocks' locations when the workers span several
    nodes. `saved_plan`: a plan (`ShardPlan.to_json()`) from the run being resumed; used when it
    fits the dataset and world size. `board`: the run's `RunBoard` actor; the plan in use is
    published there before the shards are handed out (so a worker reads it after
    `get_dataset_shard` returns), and a plan already there (an earlier worker group of the same
    run) is reused when it fits."""

    def __init__(self, shard_by_node: bool = True, saved_plan: dict | None = None, board=None, **kwargs):
        super().__init__(datasets_to_split=[TRAIN], **kwargs)
        self.shard_by_node = shard_by_node
        self.saved_plan = saved_plan
        self.board = board
        self.plan: ShardPlan | None = None  # the plan of the last `configure` (in the process that ran it)

    def _known_plans(self):
        if self.saved_plan is not None:
            yield "the saved plan", self.saved_plan
        if self.board is not None:
            import ray

            published = ray.get(self.board.shard_plan.remote())
            if published is not None:
                yield "the plan already published for this run", published

    def plan_for(self, ds, num_rows: int, world_size: int, worker_node_ids: list[str] | None) -> ShardPlan:
        """The plan to use: a known one that fits, else by node, else contiguous."""
        for what, known in self._known_plans():
            plan = ShardPlan.from_json(known)
            if plan.fits(num_rows, world_size):
                return plan
            logger.warning("not reusing %s: it shards %d rows over %d workers, this run has %d rows and %d workers",
                           what, plan.num_rows, plan.world_size, num_rows, world_size)
        nodes = worker_node_ids or []
        if self.shard_by_node and len(nodes) == world_size and len(set(nodes)) > 1:
            try:
                blocks = block_layout(ds, nodes)
                plan = ShardPlan.by_node(blocks, nodes, num_rows)
                logger.info("shard_by_node: %.1f%% of %d rows read on the node holding their block",
                            100 * plan.local_fraction(blocks, nodes), num_rows)
                return plan
            except Exception as e:  # noqa: BLE001 - locality is an optimisation; contiguous is always right
                logger.warning("shard_by_node: falling back to contiguous shards (%s: %s)", type(e).__name__, e)
        return ShardPlan.contiguous(num_rows, world_size)

    def configure(self, datasets, world_size: int, worker_handles, worker_node_ids: list[str] | None,
                  **kwargs) -> list[dict[str, object]]:
        from ray.data.dataset import MaterializedDataset

        output: list[dict[str, object]] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if name != TRAIN:  # whole, in dataset order (an elastic run's workers pick their rows by index)
                ds.context.execution_options.preserve_order = True
                for i in range(world_size):
                    output[i][name] = ds.iterator()
                continue
            if not isinstance(ds, MaterializedDataset):
                ds = ds.materialize()
            plan = self.plan_for(ds, ds.count(), world_size, worker_node_ids)
            for i, part in enumerate(realise(ds, plan)):
                output[i][name] = part.iterator()
            self.plan = plan
            if self.board is not None:
                import ray

                ray.get(self.board.publish_shard_plan.remote(plan.to_json()))
        return output


def realise(ds, plan: ShardPlan) -> list:
    """One materialised dataset per rank holding exactly `plan.rows(rank)`, in that order.

    `split_at_indices` cuts at every range boundary (a block that needs no cut keeps its object,
    hence its node; a block that does is sliced by a small SPREAD-scheduled task); a rank's
    pieces are then concatenated block list to block list. Not with `Dataset.union`: with
    `preserve_order` it interleaves its inputs block by block (round-robin), and without it
    emits blocks in arrival order."""
    pieces = sorted((s, e, rank) for rank, ranges in enumerate(plan.ranges) for s, e in ranges)
    cuts = [s for s, _, _ in pieces[1:]]
    split = ds.split_at_indices(cuts) if cuts else [ds.copy(ds)]
    piece_of = {(s, e): part for (s, e, _), part in zip(pieces, split)}
    parts = []
    for ranges in plan.ranges:
        mine = [piece_of[r] for r in ranges]
        part = mine[0] if len(mine) == 1 else _concat(mine, ds.context)
        # Blocks in a fixed order: the loader's seeded shuffle (and the batches a resume skips)
        # must see the same row sequence every time.
        part.context.execution_options.preserve_order = True
        parts.append(part)
    return parts


def _concat(parts: list, context):
    """Materialised datasets one after the other, as one materialised dataset: their blocks in
    order, nothing copied or moved. Built the way `Dataset.split_at_indices` builds its parts
    (Ray Data internals, ray 2.60: an `InputData` plan over the parts' ref bundles)."""
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators import InputData
    from ray.data._internal.stats import DatasetStats
    from ray.data.dataset import MaterializedDataset

    bundles = [bundle for part in parts for bundle in part.iter_internal_ref_bundles()]
    context = context.copy()
    return MaterializedDataset(LogicalPlan(InputData(input_data=bundles), context), context,
                               DatasetStats(metadata={"ShardPlan": []}, parent=None))
