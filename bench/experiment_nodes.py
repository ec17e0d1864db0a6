"""Experiments on 2 nodes vs 1: config-chunks per hour, where the states live, and a slot spanning nodes.

A `ray.cluster_utils.Cluster` on this machine: a head node without CPUs (the driver, the
experiment's controller) and training nodes of --cpus-per-node CPUs each. The profile's configs
(default jobs/configs/experiment_smollm2.yaml) side by side (`policy: none`), in one run:
  1. one_node: one training node, --slots-per-node slots on it;
  2. two_nodes: a second node added, the same experiment with twice the slots;
  3. spanning (unless --no-span): one slot of 2 workers, one on each node (each worker takes a
     whole node's CPUs), each worker half of every step's rows (per_device_batch_size halved):
     the one-node run's steps, so every chunk's losses must be the one-node run's.
Every way runs with lora.dropout 0 (with dropout, the spanning slot's two workers draw their own
masks: the same distribution, other values).
Reported: config-chunks per hour over each experiment's wall time and in its steady state (first
record to last: start-ups left out), the 2-node/1-node ratio (issue 20's target: >= 1.8x),
the share of swap-ins whose state was in the slot's node's object store (node preference), which
nodes the slots ran on, and the spanning run's largest relative loss difference.

On one machine the nodes share its cores, memory and loopback: the 2-node figure is bounded by the
machine's cores (give each node a core of its own: --cpus-per-node 1 on 2 cores) and crosses no
network; it measures the scheduling, the object stores and the torch.distributed group across
raylets, not a link.

    python bench/experiment_nodes.py [--profile P] [--rows 64] [--eval-rows 16] [--max-length 128]
                                     [--cpus-per-node 1] [--slots-per-node 1] [--no-span]
                                     [--out bench/results/experiment_nodes.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def say(msg: str) -> None:
    print(f"[bench experiment_nodes] {msg}", flush=True)


def rates(summary: dict, wall_s: float) -> dict:
    """Config-chunks per hour over the wall time, and in the steady state: from the first record to
    the last (the chunks finished after the first one; start-ups, data preparation and the first
    chunk's model loads left out)."""
    records = sorted((h for c in summary["configs"] for h in c["history"]), key=lambda h: h["at_s"])
    span = records[-1]["at_s"] - records[0]["at_s"] if len(records) > 1 else 0.0
    local = [h["state_on_node"] for h in records if h.get("state_on_node") is not None]
    return {"wall_s": round(wall_s, 2), "steady_s": round(span, 2), "config_chunks": len(records),
            "per_hour_wall": round(3600 * len(records) / wall_s, 1) if wall_s else None,
            "per_hour_steady": round(3600 * (len(records) - 1) / span, 1) if span else None,
            "swap_ins_from_own_node": round(sum(local) / len(local), 3) if local else None,
            "nodes": sorted({n for h in records for n in h.get("nodes", [h.get("node")]) if n}),
            "swap_fraction": summary["swap"]["fraction"], "status": summary["status"],
            "failed": [c["id"] for c in summary["configs"] if c["state"] == "failed"]}


def losses(summary: dict) -> dict:
    return {c["id"]: [(h["chunk"], h["train_loss"], h["eval_loss"]) for h in c["history"]]
            for c in summary["configs"]}


def max_rel_diff(a: dict, b: dict) -> float | None:
    """The largest relative difference of the two runs' train and held-out losses (None: other chunks)."""
    worst = 0.0
    if a.keys() != b.keys():
        return None
    for cid in a:
        if [x[0] for x in a[cid]] != [y[0] for y in b[cid]]:
            return None
        for x, y in zip(a[cid], b[cid]):
            for u, v in zip(x[1:], y[1:]):
                worst = max(worst, abs(u - v) / max(abs(v), 1e-12))
    return worst


def measure(args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    import rapidfire_ray
    from rapidfire_ray.experiments.spec import load_experiment

    work = tempfile.mkdtemp(prefix="bench-exp-nodes-")
    store = 150 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store,
                                                            "include_dashboard": False})
    runs, cpus = {}, args.cpus_per_node
    try:
        def run(name: str, slots: int, **over) -> dict:
            t = time.time()
            summary = rapidfire_ray.experiment(args.profile, address=cluster.address, overrides={
                "run.output_dir": work, "run.name": name, "experiment.rows": args.rows,
                "experiment.eval_rows": args.eval_rows, "data.max_length": args.max_length,
                "experiment.tracking": "none", "experiment.policy": "none", "experiment.num_slots": slots,
                "model.lora.dropout": 0.0,  # (the spanning slot's workers draw their own masks: compared exactly without)
                "experiment.resources.cpus": cpus / args.slots_per_node, **over})
            runs[name] = {**rates(summary, time.time() - t), "losses": losses(summary)}
            r = runs[name]
            say(f"  {name}: {r['config_chunks']} config-chunks in {r['wall_s']} s ({r['per_hour_wall']}/h; steady "
                f"{r['steady_s']} s, {r['per_hour_steady']}/h) on {len(r['nodes'])} node(s); swap-ins from the "
                f"slot's own node: {r['swap_ins_from_own_node']}")
            return summary

        cluster.add_node(num_cpus=cpus, object_store_memory=store)
        cluster.wait_for_nodes()
        plan = load_experiment(args.profile, {"run.output_dir": work, "run.name": "plan"})
        batch = int(plan.base["train"]["per_device_batch_size"])
        n = len([c for c in plan.candidates if c.error is None])
        say(f"{n} configs from {args.profile}, {args.rows} rows in {plan.spec.num_chunks} chunks; nodes of {cpus} "
            f"CPU(s), {args.slots_per_node} slot(s) each")
        say("one_node: the experiment on one training node")
        run("one_node", args.slots_per_node)
        cluster.add_node(num_cpus=cpus, object_store_memory=store)
        cluster.wait_for_nodes()
        say("two_nodes: a second node added, twice the slots")
        run("two_nodes", 2 * args.slots_per_node)
        if args.span:
            if batch % 2:
                raise SystemExit(f"--span needs an even train.per_device_batch_size (the profile's is {batch})")
            say("spanning: one slot of 2 workers, one per node, each half of every step's rows")
            run("spanning", 1, **{"experiment.resources.workers": 2, "experiment.resources.cpus": cpus,
                                  "train.per_device_batch_size": batch // 2})
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    one, two = runs["one_node"], runs["two_nodes"]
    result = {
        "benchmark": "experiment_nodes", "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": vars(args), "configs": n,
        "speedup_two_nodes": {
            "wall": round(two["per_hour_wall"] / one["per_hour_wall"], 2),
            "steady": round(two["per_hour_steady"] / one["per_hour_steady"], 2)},
        "runs": runs,
    }
    result["target_1_8x_met"] = result["speedup_two_nodes"]["steady"] >= 1.8
    if "spanning" in runs:
        result["spanning_max_rel_loss_diff"] = max_rel_diff(runs["spanning"]["losses"], one["losses"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(REPO, "jobs", "configs", "experiment_smollm2.yaml"))
    p.add_argument("--rows", type=int, default=64, help="training rows (cut into the profile's chunks)")
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--cpus-per-node", type=int, default=1, help="CPUs of each training node")
    p.add_argument("--slots-per-node", type=int, default=1)
    p.add_argument("--span", action=argparse.BooleanOptionalAction, default=True,
                   help="also one slot of 2 workers spanning the 2 nodes (--no-span: skip)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "experiment_nodes.json"))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # shut the cluster down on terminate
    # the cluster's own Ray temp dir (short: socket paths stay under 108 characters), removed after
    ray_tmp = os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rf-nodes-"))
    try:
        result = measure(args)
    finally:
        if ray_tmp.startswith(os.path.join(tempfile.gettempdir(), "rf-nodes-")):
            shutil.rmtree(ray_tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    s = result["speedup_two_nodes"]
    say(f"2 nodes vs 1: config-chunks per hour x{s['steady']} in the steady state (target 1.8x: "
        f"{'met' if result['target_1_8x_met'] else 'NOT met'}), x{s['wall']} over wall time")
    if "spanning_max_rel_loss_diff" in result:
        say(f"a slot spanning the 2 nodes: losses within {result['spanning_max_rel_loss_diff']} (relative) of one node's")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
