"""An experiment on a real 2-node cluster: slots on both nodes, and one slot whose 2 workers span the
nodes (one torch.distributed group across raylets), its first worker killed once mid-chunk.

The test session shares one embedded Ray instance (conftest.py), so the `ray.cluster_utils.Cluster`
(a head without CPUs and two nodes of 1 CPU each) runs in a subprocess, this file run as a script,
with its own Ray temp dir, and shuts down in `finally` (also on SIGTERM).
"""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from tests.cluster_script import run_cluster_script

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
PROFILE = os.path.join(REPO, "jobs", "configs", "experiment_tiny.yaml")


@pytest.mark.timeout(600)
def test_slots_on_two_nodes_and_a_slot_spanning_them_train_the_same_numbers(tmp_path):
    out = tmp_path / "summaries.json"
    log = run_cluster_script(HERE, [str(tmp_path), str(out)], prefix="rf-nodes-", timeout=540, what="the 2-node experiment")

    runs = json.loads(out.read_text())
    spread, span = ({c["id"]: c for c in runs[k]["configs"]} for k in ("spread", "span"))
    assert set(spread) == set(span) == {"c0", "c1", "c2"}
    nodes = {h["node"] for c in spread.values() for h in c["history"]}
    assert len(nodes) == 2  # the two slots ran on the two nodes
    # every chunk-2 swap-in says whether the state was in its slot's node's store
    assert all(c["history"][1]["state_on_node"] in (True, False) for c in spread.values())
    for cid, c in span.items():
        assert c["state"] == "done", (cid, c["reason"])
        for h, ref in zip(c["history"], spread[cid]["history"], strict=True):
            assert sorted(h["nodes"]) == sorted(nodes), h  # one worker on each node
            assert (h["chunk"], h["steps"], h["step"]) == (ref["chunk"], ref["steps"], ref["step"])
            assert h["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), cid
            assert h["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5), cid
    assert "config c0: its slot was lost 1 time(s)" in log and "chunk 1 runs again from its last boundary" in log


def main(run_dir: str, out_path: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally` on terminate
    import ray
    from ray.cluster_utils import Cluster

    import rapidfire_ray

    store = 100 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store,
                                                            "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        cluster.wait_for_nodes()
        common = {"run.output_dir": run_dir, "experiment.tracking": "none", "experiment.resources.cpus": 1}
        runs = {"spread": rapidfire_ray.experiment(PROFILE, address=cluster.address, overrides={
            **common, "run.name": "spread", "experiment.num_slots": 2})}
        # each worker takes a whole node's CPU: the slot's 2 workers are on the 2 nodes; c0's slot
        # (its first worker) is killed right after chunk 1 is handed to it
        os.environ["RAPIDFIRE_INJECT_KILL_SLOT"] = "c0:1"
        runs["span"] = rapidfire_ray.experiment(PROFILE, address=cluster.address, overrides={
            **common, "run.name": "span", "experiment.num_slots": 1, "experiment.resources.workers": 2,
            "train.per_device_batch_size": 4})
        with open(out_path, "w") as f:
            json.dump(runs, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
