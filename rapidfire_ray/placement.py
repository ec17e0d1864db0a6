"""Before Ray Train starts the workers: ask the cluster for them, visibly.

Ray Train (V2) reserves its workers with a placement group and, while the cluster cannot hold
it, retries quietly every RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s) forever. Here the driver
first reserves a placement group of the same bundles and strategy itself: that is the resource
request the autoscaler acts on (it adds nodes of a type that has the resources), and while it is
pending the driver prints what it waits for and what the cluster has, and gives up after
`scaling.placement_timeout_s` with one line. Once placed, the reservation is released and Ray
Train places its own group on the same (now present) nodes.
"""
from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from .errors import RapidfireError


def on_driver_node():
    """A scheduling strategy for the run's own small actors (progress board, control): on the
    driver's node, not soft. A run's state must not sit on a worker node that a preemption or a
    crash takes away while the driver (and the run) goes on; the driver's node lives as long as
    the run does."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def _show(resources: dict) -> str:
    """{CPU: 1, GPU: 8} with integral amounts without '.0'."""
    parts = []
    for key in sorted(resources):
        value = resources[key]
        value = int(value) if float(value).is_integer() else round(value, 3)
        parts.append(f"{key}: {value}")
    return "{" + ", ".join(parts) + "}"


def _visible(resources: dict) -> dict:
    """Resources a user asks for: no per-node (`node:...`), memory or object-store entries."""
    return {k: v for k, v in resources.items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")
            and not k.startswith("accelerator_type:")}


def cluster_line() -> str:
    """'N node(s), total {...}, free {...}' for the connected cluster."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return (f"{len(alive)} node(s), total {_show(_visible(ray.cluster_resources()))}, "
            f"free {_show(_visible(ray.available_resources()))}")


def _never_fits(bundle: dict, num_workers: int) -> str | None:
    """With an autoscaler: the resource the cluster config can never provide, as a phrase."""
    try:
        most = ray._private.state.state.get_max_resources_from_cluster_config()
    except Exception:  # no autoscaler (a fixed cluster), or an older/newer Ray without this
        return None
    if not most:
        return None
    for key, amount in bundle.items():
        if amount * num_workers > most.get(key, 0):
            return f"{key}: {amount * num_workers:g} needed, the autoscaler config allows at most {most.get(key, 0):g}"
    return None


def wait_for_workers(bundle: dict, num_workers: int, strategy: str, timeout_s: float, say,
                     every_s: float = 5.0) -> float:
    """Reserve `num_workers` x `bundle` (strategy PACK/SPREAD) and release it once placed.
    Returns the seconds waited; prints a wait line every `every_s` while it is pending; raises
    RapidfireError after `timeout_s` (0: wait forever)."""
    what = f"{num_workers} x {_show(bundle)}"
    never = _never_fits(bundle, num_workers)
    if never is not None:
        raise RapidfireError(f"scaling: the workers ({what}) can never be placed on this cluster ({never}); "
                             f"cluster has {cluster_line()}; lower scaling.num_workers or "
                             "scaling.resources_per_worker, or add a node type that has them")
    pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy,
                         name=f"rapidfire-placement-check-{time.time_ns()}")
    start = time.monotonic()
    try:
        first = True
        while True:
            waited = time.monotonic() - start
            left = every_s if not timeout_s else min(every_s, max(0.0, timeout_s - waited))
            ready, _ = ray.wait([pg.ready()], timeout=min(2.0, left) if first else left)
            waited = time.monotonic() - start
            if ready:
                if not first:
                    say(f"workers placed after {waited:.0f} s ({what})")
                return waited
            if timeout_s and waited >= timeout_s:
                raise RapidfireError(f"scaling.placement_timeout_s: the cluster could not place {what} "
                                     f"({strategy}) within {timeout_s:g} s; cluster has {cluster_line()}; add "
                                     "nodes with these resources, lower scaling.num_workers or "
                                     "scaling.resources_per_worker, or raise scaling.placement_timeout_s (0 waits "
                                     "forever)")
            limit = f"{timeout_s:g} s" if timeout_s else "no limit"
            say(f"waiting for {what} ({strategy}) to be placed: {waited:.0f} s of {limit} (cluster has "
                f"{cluster_line()})")
            first = False
    finally:
        remove_placement_group(pg)
