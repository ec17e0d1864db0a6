"""shard_by_node on a real 2-node cluster: rows are read on the node that produced their block.

The test session shares one embedded Ray instance (conftest.py), so the 2-node
`ray.cluster_utils.Cluster` runs in a subprocess: this file run as a script, with its own Ray
temp dir (RAY_TMPDIR, so its address file and sockets never touch another Ray instance), shutting
its cluster down in `finally` (also on SIGTERM). Blocks are ~400 KB, so they live in a node's object
store (smaller ones are inlined in the owner's memory and have no node).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
NUM_ROWS = 4000
BLOCKS_PER_NODE = 25
EXTRA_ROWS_ON_NODE0 = 50  # node 0 makes 2050 rows (25 blocks of 82), node 1 1950 (25 of 78)
PAYLOAD_BYTES = 5000  # per row: blocks of ~400 KB


def _ray_processes_using(path: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(path in arg for arg in p.info["cmdline"] or []):
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.timeout(110)
def test_two_node_cluster_reads_at_least_90_percent_of_rows_on_their_node(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="rf-loc-")  # short: Ray's socket paths must stay under 108 chars
    out = tmp_path / "locality.json"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": "",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, HERE, str(out)], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script shuts its cluster down before exiting
        try:
            log, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        pytest.fail(f"the 2-node locality run timed out:\n{log[-4000:]}")
    finally:
        leftovers = _ray_processes_using(ray_tmp)
        if not leftovers:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, log[-6000:]
    assert not leftovers, f"Ray processes of the 2-node cluster still running: {leftovers}"

    r = json.loads(out.read_text())
    n = NUM_ROWS
    print(f"\nlocality: {r['local_rows']}/{n} rows read on their producer's node "
          f"({100 * r['measured_local']:.1f}%; the plan predicted {100 * r['plan_local']:.1f}%, contiguous shards "
          f"would read {100 * r['contiguous_local']:.1f}% locally), "
          f"blocks per node {r['blocks_per_node']}, timings {r['timings']}")
    assert sorted(r["ids"]) == list(range(n))  # every row exactly once across the two ranks
    assert r["rows_per_rank"] == [n // 2, n // 2]
    assert r["in_plan_order"] == [True, True]
    assert sorted(r["blocks_per_node"].values()) == [BLOCKS_PER_NODE] * 2  # each block on its node
    assert r["contiguous_local"] <= 0.6
    assert r["plan_local"] == (n - EXTRA_ROWS_ON_NODE0) / n  # the most a plan can keep local
    assert r["measured_local"] >= 0.9


def main(out_path: str) -> None:
    """The 2-node run (needs RAY_TMPDIR set to a private dir); writes its measurements to `out_path`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally` on terminate
    timings = {}
    t0 = time.perf_counter()
    from collections import Counter

    import numpy as np
    import ray
    from ray.cluster_utils import Cluster

    from rapidfire_ray.data.sharding import (
        TRAIN,
        ExactSplitDataConfig,
        ShardPlan,
        block_layout,
    )

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node0": 1}, "object_store_memory": 100 * 1024 * 1024,
        "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"node1": 1}, object_store_memory=100 * 1024 * 1024)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        timings["cluster_s"] = round(time.perf_counter() - t0, 1)

        ray.data.DataContext.get_current().execution_options.preserve_order = True

        def produce(node: str, first_id: int, rows: int):
            """`rows` rows made on `node`, in BLOCKS_PER_NODE blocks, each row tagged with its node."""
            def tag(batch):
                batch["id"] = batch["id"] + first_id
                batch["producer"] = np.array([ray.get_runtime_context().get_node_id()] * len(batch["id"]))
                batch["payload"] = np.zeros((len(batch["id"]), PAYLOAD_BYTES), dtype=np.uint8)
                return batch

            return (ray.data.range(rows, override_num_blocks=BLOCKS_PER_NODE)
                    .map_batches(tag, batch_size=None, resources={node: 0.01}).materialize())

        t = time.perf_counter()
        n0 = NUM_ROWS // 2 + EXTRA_ROWS_ON_NODE0  # more than a rank reads: one block must be cut
        # With preserve_order, union alternates the inputs block by block (and moves no block):
        # contiguous shards would read only about half their rows locally.
        ds = produce("node0", 0, n0).union(produce("node1", n0, NUM_ROWS - n0)).materialize()
        timings["materialise_s"] = round(time.perf_counter() - t, 1)

        @ray.remote(num_cpus=0)
        class Consumer:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

            def consume(self, it) -> tuple[list[int], int]:
                me = self.node()
                ids, local = [], 0
                for b in it.iter_batches(batch_size=256, batch_format="numpy"):
                    ids.extend(int(i) for i in b["id"])
                    local += int(np.sum(b["producer"] == me))
                return ids, local

        consumers = [Consumer.options(resources={f"node{i}": 0.01}).remote() for i in range(2)]
        node_ids = ray.get([c.node.remote() for c in consumers])
        assert len(set(node_ids)) == 2, node_ids

        t = time.perf_counter()
        blocks = block_layout(ds, node_ids)
        config = ExactSplitDataConfig()
        iterators = config.configure({TRAIN: ds}, 2, None, node_ids)
        timings["configure_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        results = ray.get([c.consume.remote(its[TRAIN]) for c, its in zip(consumers, iterators)])
        timings["consume_s"] = round(time.perf_counter() - t, 1)

        # Each rank read its plan's rows in plan order (global order read back on the driver, after).
        global_ids = np.concatenate([b["id"] for b in ds.select_columns(["id"]).iter_batches(batch_format="numpy")])
        in_plan_order = [rank_ids == global_ids[config.plan.rows(rank)].tolist()
                         for rank, (rank_ids, _) in enumerate(results)]
        local_rows = sum(local for _, local in results)
        ids = [i for rank_ids, _ in results for i in rank_ids]
        report = {"ids": ids, "rows_per_rank": [len(rank_ids) for rank_ids, _ in results],
                  "local_rows": local_rows, "measured_local": local_rows / len(ids),
                  "plan_local": config.plan.local_fraction(blocks, node_ids),
                  "contiguous_local": ShardPlan.contiguous(len(ids), 2).local_fraction(blocks, node_ids),
                  "blocks_per_node": dict(Counter(str(node)[:8] for _, _, node in blocks)),
                  "in_plan_order": in_plan_order, "timings": timings}
        with open(out_path, "w") as f:
            json.dump(report, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
