"""The chunk scheduler: same chunks in the same order for every config, fair hand-out, successive halving."""
from __future__ import annotations

import random

from rapidfire_ray.experiments.scheduler import DONE, FAILED, STOPPED, ChunkScheduler


def _drive(sched: ChunkScheduler, slots: int, score, seed: int = 0) -> list[tuple[str, int]]:
    """Run the scheduler with `slots` slots finishing in a random order; the (config, chunk) pairs in start order."""
    rng = random.Random(seed)
    started, flying = [], []
    while True:
        sched.cut()
        while len(flying) < slots and (pair := sched.next_pair()) is not None:
            started.append(pair)
            flying.append(pair)
        if not flying:
            assert sched.idle()
            return started
        cid, chunk = flying.pop(rng.randrange(len(flying)))
        sched.finished(cid, score(cid, chunk))


def test_every_config_trains_every_chunk_in_order():
    for slots in (1, 2, 3, 5):
        sched = ChunkScheduler(num_chunks=4)
        for i in range(5):
            sched.add(f"c{i}")
        started = _drive(sched, slots, lambda c, k: 1.0, seed=slots)
        for i in range(5):
            assert [k for c, k in started if c == f"c{i}"] == [0, 1, 2, 3]
        assert all(c.state == DONE for c in sched.configs.values())


def test_fewest_chunks_first_keeps_configs_together():
    sched = ChunkScheduler(num_chunks=3)
    for i in range(4):
        sched.add(f"c{i}")
    started = _drive(sched, 1, lambda c, k: 1.0)
    # one slot: every config's chunk k before anyone's chunk k+1
    assert [k for _, k in started] == [0] * 4 + [1] * 4 + [2] * 4
    assert [c for c, _ in started[:4]] == ["c0", "c1", "c2", "c3"]


def test_successive_halving_keeps_the_best_one_over_eta():
    scores = {"c0": 3.0, "c1": 1.0, "c2": 4.0, "c3": 2.0, "c4": 5.0, "c5": 0.5, "c6": 6.0, "c7": 7.0}
    sched = ChunkScheduler(num_chunks=4, policy="successive_halving", eta=2)
    for cid in scores:
        sched.add(cid)
    started = _drive(sched, 3, lambda c, k: scores[c] + 0.01 * k, seed=1)
    assert [cut["kept"] for cut in sched.cuts] == [["c5", "c1", "c3", "c0"], ["c5", "c1"], ["c5"]]
    assert sched.configs["c5"].state == DONE and sched.configs["c5"].chunks_done == 4
    for cid in ("c2", "c4", "c6", "c7"):
        assert sched.configs[cid].state == STOPPED and sched.configs[cid].chunks_done == 1
    assert "rank" in sched.configs["c7"].reason
    # no config started a chunk past a cut before the cut was made
    assert sum(1 for _, k in started if k == 0) == 8 and sum(1 for _, k in started if k == 1) == 4


def test_min_chunks_delays_the_first_cut_and_failed_configs_drop_out():
    sched = ChunkScheduler(num_chunks=3, policy="successive_halving", eta=3, min_chunks=2)
    for i in range(4):
        sched.add(f"c{i}")
    pair = sched.next_pair()
    sched.failed(pair[0], "boom")
    started = _drive(sched, 2, lambda c, k: float(c[1:]))
    assert sched.configs["c0"].state == FAILED
    assert sched.cuts == [{"after_chunk": 2, "kept": ["c1"], "stopped": ["c2", "c3"]}]
    assert [k for c, k in started if c == "c1"] == [0, 1, 2]


def test_nan_scores_rank_last():
    sched = ChunkScheduler(num_chunks=2, policy="successive_halving", eta=2)
    for cid in ("a", "b"):
        sched.add(cid)
    _drive(sched, 2, lambda c, k: float("nan") if c == "a" else 9.0)
    assert sched.cuts[0]["kept"] == ["b"]


def test_pbt_replaces_the_worst_quantile_by_the_best_at_each_boundary():
    scores = {"c0": 3.0, "c1": 1.0, "c2": 4.0, "c3": 2.0, "c4": 5.0, "c5": 0.5, "c6": 6.0, "c7": 7.0}
    sched = ChunkScheduler(num_chunks=3, policy="pbt", min_chunks=1, quantile=0.25)
    for cid in scores:
        sched.add(cid)
    flying = [sched.next_pair() for _ in range(8)]
    assert sched.next_pair() is None and all(k == 0 for _, k in flying)
    for cid, _ in flying[:7]:
        sched.finished(cid, scores[cid])
    assert sched.cut() == [] and sched.next_pair() is None  # c7 is still on its way to the boundary
    sched.finished("c7", scores["c7"])
    # ceil(0.25 * 8) = 2: the last (c7) is replaced by a clone of the best (c5), c6 by one of c1
    assert sched.cut() == ["c7", "c6"]
    assert sched.take_exploits() == [{"after_chunk": 1, "parent": "c5", "replaces": "c7"},
                                     {"after_chunk": 1, "parent": "c1", "replaces": "c6"}]
    assert sched.take_exploits() == []
    assert sched.configs["c7"].state == STOPPED and "rank 8 of 8, replaced by a warm clone of c5" in sched.configs["c7"].reason
    assert "rank 7 of 8" in sched.configs["c6"].reason
    assert sched.cuts == [{"after_chunk": 1, "kept": ["c5", "c1", "c3", "c0", "c2", "c4"], "stopped": ["c7", "c6"],
                           "cloned": ["c5", "c1"]}]
    # the clones join at the boundary (as the driver adds them, warm) and the population keeps its size
    sched.add("c8", chunks_done=1)
    sched.add("c9", chunks_done=1)
    assert len(sched.live()) == 8
    started = [sched.next_pair() for _ in range(8)]
    assert sorted(k for _, k in started) == [1] * 8


def test_pbt_with_few_configs_replaces_at_most_half():
    for n, replaced in ((1, 0), (2, 1), (3, 1), (4, 2), (5, 2)):
        sched = ChunkScheduler(num_chunks=2, policy="pbt", quantile=0.5)
        for i in range(n):
            sched.add(f"c{i}")
        for _ in range(n):
            cid, _ = sched.next_pair()
            sched.finished(cid, float(cid[1:]))
        assert len(sched.cut()) == replaced, n
        assert len(sched.take_exploits()) == replaced


def test_co_batched_groups_share_a_chunk_and_a_key_and_keep_the_order():
    sched = ChunkScheduler(num_chunks=2, policy="successive_halving", eta=2)
    for i in range(5):
        sched.add(f"c{i}")
    key = {"c0": "a", "c1": "b", "c2": "a", "c3": "a", "c4": "b"}.get
    assert sched.next_group(2, key) == (["c0", "c2"], 0)
    assert sched.next_group(2, key) == (["c1", "c4"], 0)
    assert sched.next_group(2, key) == (["c3"], 0)  # its key's other members are in flight
    assert sched.next_group(2, key) is None
    for cid, score in (("c0", 1.0), ("c2", 5.0), ("c1", 2.0), ("c4", 4.0)):
        sched.finished(cid, score)
    assert sched.next_group(2, key) is None  # c3 still on chunk 0: the boundary is held for the cut
    sched.finished("c3", 3.0)
    assert sched.cut() == ["c3", "c4", "c2"]  # kept the best 5 // 2 of one ranking over both groups
    assert [c.id for c in sched.live()] == ["c0", "c1"]
    assert sched.next_group(4, key) == (["c0"], 1)  # different keys never share a pass
    assert sched.next_group(4, key) == (["c1"], 1)
    sched.finished("c0", 1.0)
    sched.finished("c1", 1.0)
    assert sched.idle()


def test_a_solo_config_trains_alone_and_is_never_joined():
    sched = ChunkScheduler(num_chunks=1)
    for i in range(3):
        sched.add(f"c{i}")
    sched.configs["c0"].solo = True
    assert sched.next_group(3) == (["c0"], 0)
    assert sched.next_group(3) == (["c1", "c2"], 0)


def test_a_slot_prefers_configs_whose_state_is_on_its_node_within_the_fewest_chunks():
    sched = ChunkScheduler(num_chunks=3)
    for i in range(4):
        sched.add(f"c{i}")
    on_node = {"c2", "c3"}.__contains__
    assert sched.next_pair(on_node) == ("c2", 0)
    assert sched.next_group(2, prefer=on_node) == (["c3", "c0"], 0)
    sched.finished("c2", 1.0)
    sched.finished("c3", 1.0)
    # fewest chunks first still: c1 (chunk 0) before the preferred c2 (chunk 1)
    assert sched.next_pair(on_node) == ("c1", 0)
    sched.finished("c0", 1.0)
    sched.finished("c1", 1.0)
    assert sched.next_pair({"c1"}.__contains__) == ("c1", 1)
