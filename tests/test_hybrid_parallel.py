"""--hybrid_parallel on a real 2-node cluster: 4 workers, 2 per node, ZeRO-3 with hpZ groups of one
node each.

The test session shares one embedded Ray instance (conftest.py), so the 2-node
`ray.cluster_utils.Cluster` runs in a subprocess (this file run as a script) with its own Ray temp
dir, and shuts down in `finally` (also on SIGTERM). Each node offers 3 CPUs: its 2 workers and one
for Ray Data.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from tests.cluster_script import run_cluster_script

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


@pytest.mark.timeout(400)
def test_hybrid_parallel_groups_workers_by_node_and_trains(tmp_path):
    out = tmp_path / "summary.json"
    run_cluster_script(HERE, [str(tmp_path), str(out)], prefix="rf-hyb-", timeout=360, what="the 2-node hybrid run")

    s = json.loads(out.read_text())
    mem = s["memory"]
    assert s["steps"] == 3 and s["num_workers"] == 4 and s["final_loss"] < s["first_loss"]
    assert mem["options"]["hybrid"] and mem["options"]["zero_stage"] == 3
    held = mem["held_bytes_per_worker"]
    nodes = [h["node_id"] for h in held]
    # Ray Train numbers workers node by node, so hpZ's groups of consecutive ranks are the nodes.
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    assert [h["hpz_group_size"] for h in held] == [2] * 4
    # Primary partitions over all 4 workers: each holds about a quarter of the optimizer state that a
    # replicated worker would (2 fp32 moments per parameter).
    from rapidfire_ray.models import model_num_parameters

    params = model_num_parameters("tiny-random")
    for h in held:
        assert h["optimizer_state"] < 0.3 * 8 * params, h


def main(run_dir: str, out_path: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally` on terminate
    import ray
    from ray.cluster_utils import Cluster

    import rapidfire_ray

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "object_store_memory": 100 * 1024 * 1024, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=3, object_store_memory=100 * 1024 * 1024)
        cluster.wait_for_nodes()
        summary = rapidfire_ray.train(TINY, address=cluster.address, overrides={
            "run.output_dir": run_dir, "run.name": "hybrid", "train.max_steps": 3, "checkpoint.every_steps": 0,
            "scaling.num_workers": 4, "scaling.placement": "SPREAD", "scaling.hybrid_parallel": True,
            "train.per_device_batch_size": 4})
        with open(out_path, "w") as f:
            json.dump(summary, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
