"""How many CPUs this machine has and whether a run's workers fit in them: checked before Ray
(or anything heavy) is imported, so a run that cannot fit is refused in a second or two."""
from __future__ import annotations

import math
import os
import sys

from omegaconf import DictConfig

from .config import worker_range
from .errors import RapidfireError

SHARD_CPUS = 0.25  # reserved per parameter-server shard actor: it decodes, steps AdamW and encodes as updates arrive


def machine_cpus() -> int:
    """CPUs this process may use: the affinity mask (taskset, a container's cpuset) and a cgroup
    v2 CPU quota (`cpu.max`) where one is set, else os.cpu_count()."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def run_cpus(cfg: DictConfig, extra_cpus: float = 0.0) -> tuple[float, float]:
    """(the workers' CPUs at the run's largest size, the run's actors' CPUs: `extra_cpus` (the RL
    reward pool) and the parameter-server shards)."""
    workers = worker_range(cfg)[1] * cfg.scaling.cpus_per_worker
    actors = float(extra_cpus)
    if cfg.communication.mode == "parameter_server":  # one shard by default on one machine
        actors += SHARD_CPUS * (cfg.communication.ps.num_shards or 1)
    return workers, actors


def _joins_a_cluster(address: str | None) -> bool:
    ray = sys.modules.get("ray")  # an already connected driver (tests, notebooks) is not checked
    return bool(address or os.environ.get("RAY_ADDRESS")) or bool(ray is not None and ray.is_initialized())


def check_fits_here(cfg: DictConfig, address: str | None = None) -> None:
    """A run for an embedded cluster whose workers need more CPUs than this machine has is refused
    in one line (its workers could never all be placed)."""
    if _joins_a_cluster(address):
        return
    workers, _ = run_cpus(cfg)
    here = machine_cpus()
    if workers > here:
        hi = worker_range(cfg)[1]
        raise RapidfireError(f"scaling: {hi} worker(s) x {cfg.scaling.cpus_per_worker:g} CPU(s) = {workers:g} CPUs "
                             f"needed, this machine has {here}; lower scaling.num_workers or scaling.cpus_per_worker "
                             f"(at most {here} CPUs in all), or pass --address of a Ray cluster that has them")


def fit_scale(cfg: DictConfig, extra_cpus: float, cpus: int) -> float:
    """The factor an embedded cluster of `cpus` CPUs scales the run's CPU reservations by so
    that workers and actors fit with one CPU left for Ray Data's tasks (1.0: they fit as asked)."""
    workers, actors = run_cpus(cfg, extra_cpus)
    room = cpus - 1 if cpus >= 2 else cpus
    total = workers + actors
    return 1.0 if total <= room or total <= 0 else room / total
