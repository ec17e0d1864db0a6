"""What a `ParameterShard` learns from Ray about the actor it runs in: its metrics endpoint
when it is a run's named shard, and whether Ray restarted it."""
from __future__ import annotations


def shard_metrics(index: int):
    """`telemetry.metrics.ShardMetrics` for a shard actor named `rapidfire-ps-<run>-<index>`
    (what `ps.driver` starts for a run), else None (tests, other callers)."""
    try:
        import ray

        name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    except Exception:
        return None
    prefix, suffix = "rapidfire-ps-", f"-{index}"
    if not name or not name.startswith(prefix) or not name.endswith(suffix):
        return None
    from ..telemetry.metrics import ShardMetrics

    return ShardMetrics(name[len(prefix):-len(suffix)], index)


def reconstructed() -> bool:
    try:
        import ray
        if not ray.is_initialized():
            return False
        import warnings
        with warnings.catch_warnings():  # ray reads its own deprecated actor_id property here
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 -- not inside an actor
        return False
