"""Steering a running experiment: its named controller actor and the `ctl` client side.

`ExperimentController` (`rapidfire-experiment-<name>` in namespace `rapidfire`) only queues what
people ask for and holds the leaderboard the driver publishes (recording each config's gauges,
telemetry/metrics.py); the driver takes the queue at
every pass and applies an op at the target config's next chunk boundary (never mid-chunk), then
records who asked, when, what, and at which boundary it was applied (`ctl_log.jsonl`).
"""
from __future__ import annotations

import getpass
import os
import socket
import time

import ray

from ..errors import RapidfireError

NAMESPACE = "rapidfire"
PREFIX = "rapidfire-experiment-"
OPS = ("stop", "resume", "delete", "clone")


def controller_name(experiment: str) -> str:
    return f"{PREFIX}{experiment}"


@ray.remote(num_cpus=0)
class ExperimentController:
    def __init__(self, experiment: str):
        self.experiment = experiment
        self.queue: list[dict] = []
        self.board: dict = {}
        self.count = 0

    def submit(self, op: dict) -> int:
        self.count += 1
        self.queue.append({**op, "op_id": self.count})
        return self.count

    def take(self) -> list[dict]:
        ops, self.queue = self.queue, []
        return ops

    def publish(self, board: dict) -> None:
        self.board = board
        try:  # per-config gauges on the Ray dashboard / metrics endpoint
            from ..telemetry.metrics import record_experiment

            record_experiment(board)
        except Exception:  # noqa: BLE001 - metrics never stop an experiment
            pass

    def leaderboard(self) -> dict:
        return self.board


def start_controller(experiment: str):
    from ..driver.cluster import on_driver_node

    name = controller_name(experiment)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return ExperimentController.options(name=name, namespace=NAMESPACE,
                                            scheduling_strategy=on_driver_node()).remote(experiment)
    raise RapidfireError(f"run.name: experiment '{experiment}' is already running on this Ray cluster (actor "
                         f"{name}); wait for it or choose another run.name")


def who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in a container
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def make_op(op: str, run: str, overrides: dict | None = None, warm: bool = False) -> dict:
    if op not in OPS:
        raise RapidfireError(f"ctl: '{op}' is not one of: {', '.join(OPS)}")
    if op != "clone" and (overrides or warm):
        raise RapidfireError(f"ctl {op}: key=value and --warm go with clone only")
    return {"op": op, "run": run, "overrides": dict(overrides or {}), "warm": bool(warm), "who": who(),
            "asked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def find_controller(experiment: str | None):
    """(name, controller handle) of `experiment`, or of the only running one."""
    names = sorted(a["name"][len(PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))
    if experiment is None:
        if len(names) != 1:
            raise RapidfireError("no experiment is running on this Ray cluster; start one with rapidfire experiment"
                                 if not names else f"{len(names)} experiments are running ({', '.join(names)}); "
                                                   "choose one with --name")
        experiment = names[0]
    elif experiment not in names:
        raise RapidfireError(f"experiment '{experiment}' is not running on this Ray cluster"
                             + (f" (running: {', '.join(names)})" if names else "") + "; check --name and --address")
    return experiment, ray.get_actor(controller_name(experiment), namespace=NAMESPACE)


def ctl(op: str, run: str, overrides: dict | None = None, warm: bool = False, experiment: str | None = None) -> dict:
    """Queue an op on a running experiment (this process connected to its cluster); the op as queued."""
    entry = make_op(op, run, overrides, warm)
    experiment, controller = find_controller(experiment)
    board = ray.get(controller.leaderboard.remote(), timeout=30)
    ids = [c["id"] for c in board.get("configs", [])]
    if ids and run not in ids:
        raise RapidfireError(f"ctl {op}: no config '{run}' in experiment '{experiment}'; its configs: {', '.join(ids)}")
    entry["op_id"] = ray.get(controller.submit.remote(entry), timeout=30)
    entry["experiment"] = experiment
    return entry
