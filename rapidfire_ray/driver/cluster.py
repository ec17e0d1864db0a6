"""The cluster side of a run: join or start Ray, wait visibly for the workers' placement, and
start and watch Ray Train's worker group."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import ray
from omegaconf import DictConfig
from ray.util.placement_group import placement_group, remove_placement_group

from .. import faults, log
from ..checkpoints.ledger import settle_after_fit
from ..config import worker_range
from ..data.sharding import TRAIN
from ..errors import RapidfireError, RunFailed
from .failure import RunInterrupted, describe_failure
from ..log import say
from ..capacity import check_fits_here, fit_scale, machine_cpus
from ..telemetry.control import ControlWatcher
from ..telemetry.progress import ProgressPrinter

# Every worker process's environment; log.worker_env() adds how quiet the libraries are.
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def worker_env() -> dict[str, str]:
    """WORKER_ENV with the log level's environment (quiet libraries unless --verbose)."""
    return {**WORKER_ENV, **log.worker_env()}


def workers_text(cfg: DictConfig) -> str:
    lo, hi = worker_range(cfg)
    return f"{lo} worker(s)" if lo == hi else f"{lo} to {hi} workers (elastic, batch policy {cfg.scaling.elastic.batch})"


def _probe(address: str) -> None:
    """Fail fast on an ip:port where nothing listens (ray.init would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", ray:// client addresses, http:// job addresses: left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise RapidfireError(f"--address '{address}': could not connect to a Ray cluster (nothing answers at "
                             f"{host}:{port}: {e.strerror or e}); check the address and that `ray start --head` "
                             "is running there") from None


# The embedded cluster this process started: its address and CPUs, and the factor the run's CPU
# reservations are scaled by so that workers, actors and one CPU for Ray Data fit in them.
_embedded: dict = {}


def cpu_share(cpus: float) -> float:
    """A CPU reservation (a worker's, an actor's) as made on the connected cluster: as asked on a
    cluster joined with --address; on the embedded one scaled so the run fits this machine's CPUs
    (the work still runs with the threads it was given; only Ray's bookkeeping is shared)."""
    if _embedded and ray.is_initialized() and _embedded.get("address") == _gcs_address():
        return round(cpus * _embedded["scale"], 4)
    return cpus


def _gcs_address() -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - not connected
        return None


def connect(address: str | None, cfg: DictConfig, extra_cpus: float = 0.0) -> None:
    """Join the cluster at `address`/RAY_ADDRESS (a `ray job submit` job has it set), reuse an
    already connected one, or start an embedded local cluster of this machine's CPUs (never more:
    `check_fits_here` refuses a run whose workers need more; when workers, the run's actors
    (`extra_cpus`: the RL reward pool; parameter-server shards) and one CPU for Ray Data exceed
    them, their reservations are scaled down to share them)."""
    log.quiet_libraries()
    if ray.is_initialized():
        if _embedded and _embedded.get("address") == _gcs_address():
            _embedded["scale"] = fit_scale(cfg, extra_cpus, _embedded["cpus"])  # this stage's share
        return
    address = address or os.environ.get("RAY_ADDRESS")
    _embedded.clear()
    if address:
        _probe(address)
        # No runtime_env here: inside `ray job submit` it would replace the job's (its working_dir);
        # the training workers get worker_env() through RunConfig.worker_runtime_env instead.
        try:
            ray.init(address=address, log_to_driver=True, logging_level=log.ray_logging_level())
        except Exception as e:  # ConnectionError, auth errors, bad address formats
            raise RapidfireError(f"--address '{address}': could not connect to a Ray cluster "
                                 f"({str(e).splitlines()[0][:200]}); check the address (ip:port or auto), that the "
                                 "cluster is up, and RAY_AUTH_MODE=token with its token for a token-auth cluster")
        log.filter_worker_output()
        say(f"connected to Ray cluster at {address}")
        return
    check_fits_here(cfg)
    num_cpus = machine_cpus()
    ray.init(num_cpus=num_cpus, runtime_env={"env_vars": worker_env()}, log_to_driver=True,
             logging_level=log.ray_logging_level(), _system_config=EMBEDDED_SYSTEM_CONFIG)
    log.filter_worker_output()
    scale = fit_scale(cfg, extra_cpus, num_cpus)
    _embedded.update(address=_gcs_address(), cpus=num_cpus, scale=scale)
    note = "" if scale == 1.0 else (f"; the run's CPU reservations scaled x{scale:.2f} to share them, "
                                    "one kept for Ray Data")
    say(f"started an embedded local Ray cluster ({num_cpus} CPUs{note})")


#: Ray settings of the embedded cluster. Ray kills workers beyond its per-CPU pool after 1 s idle;
#: data preparation runs one short Ray Data pass after another, and on 2 cores each pass then
#: waited seconds for fresh worker processes (column_sums: 3.7 s, 0.17 s with workers kept; a tiny
#: run's data stage 24.5 -> 18.1 s; measured 2026-12-07). Idle workers are kept for a minute.
EMBEDDED_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 60_000}


def on_driver_node():
    """A scheduling strategy for the run's own small actors (progress board, control): on the
    driver's node, not soft, so a run's state never sits on a worker node a preemption takes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


# --------------------------------------------------------------------------------------------
# placement: Ray Train retries a group it cannot place quietly forever; the driver first reserves
# the same bundles itself (the request an autoscaler acts on), says what it waits for, and gives
# up after scaling.placement_timeout_s. Once placed, the reservation is released.


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


def wait_for_workers(bundle: dict, num_workers: int, strategy: str, timeout_s: float, say=say,
                     every_s: float = 5.0) -> float:
    """Reserve `num_workers` x `bundle` (strategy PACK/SPREAD) and release it once placed.
    Returns the seconds waited; says a wait line every `every_s` while it is pending; raises
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


# --------------------------------------------------------------------------------------------
# Ray Train


def trainer_class(cfg: DictConfig):
    """Ray Train with its torch backend (a gloo/NCCL process group per run), or, for the
    parameter server, without one: its workers exchange nothing but pushes and pulls."""
    if cfg.communication.mode == "parameter_server":
        from ray.train import BackendConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        return lambda *a, **kw: DataParallelTrainer(*a, backend_config=BackendConfig(), **kw)
    from ray.train.torch import TorchTrainer

    return TorchTrainer


def fit_workers(cfg: DictConfig, loop, loop_config: dict, *, ds, board, dataset_config, start_line: str,
                control=None, trainer_class=None, extra_env: dict | None = None, max_failures: int | None = None,
                more_datasets: dict | None = None):
    """Ray Train's worker group for a run, started and watched: the workers' resource request
    made visible (and bounded by scaling.placement_timeout_s) while the cluster or its autoscaler
    cannot place it, the workers' environment (ours, injected faults, `extra_env`), failures
    survived up to scaling.max_failures (or `max_failures`), the progress line and live control
    printed while it trains. Returns Ray Train's Result; a failed run raises RunFailed."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    lo, hi = worker_range(cfg)
    elastic = {"elastic_resize_monitor_interval_s": cfg.scaling.elastic.resize_interval_s} if lo != hi else {}
    trainer = (trainer_class or TorchTrainer)(
        loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=(lo, hi) if lo != hi else lo, use_gpu=cfg.scaling.use_gpu, **elastic,
                                     resources_per_worker={"CPU": cpu_share(cfg.scaling.cpus_per_worker),
                                                           **cfg.scaling.resources_per_worker},
                                     placement_strategy=cfg.scaling.placement),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=os.path.abspath(cfg.run.output_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.scaling.max_failures if max_failures is None
                                         else max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": {**worker_env(), **faults.worker_env(),
                                             "OMP_NUM_THREADS": str(cfg.scaling.cpus_per_worker),
                                             # DeepSpeed's accelerator probe on a CPU worker (and its warning)
                                             **({"DS_ACCELERATOR": "cpu"} if not cfg.scaling.use_gpu else {}),
                                             **(extra_env or {})}},
        ),
        datasets={TRAIN: ds, **(more_datasets or {})},
        dataset_config=dataset_config,
    )
    scaling = trainer.scaling_config
    wait_for_workers(scaling._resources_per_worker_not_none, lo, cfg.scaling.placement,
                     cfg.scaling.placement_timeout_s)
    say(start_line)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    interrupted = _watch_sigint(trainer)
    with ProgressPrinter(board), (ControlWatcher(control) if control is not None else contextlib.nullcontext()):
        try:
            result = trainer.fit()
        except KeyboardInterrupt:
            raise RunInterrupted("interrupted") from None
        except Exception as e:
            if interrupted:
                raise RunInterrupted("interrupted") from None
            raise RunFailed(f"training failed: {describe_failure(e)}") from e
        finally:
            if main_thread and previous is not None:
                signal.signal(signal.SIGINT, previous)  # Ctrl-C after the run: Python's default again
            # checkpoints a restarted worker group resumed from unregistered: in Ray's record, pruned by keep
            try:
                settle_after_fit(os.path.join(os.path.abspath(cfg.run.output_dir), cfg.run.name),
                                 cfg.checkpoint.keep, say=say)
            except (OSError, ValueError) as e:
                say(f"warning: could not reconcile the run's checkpoints with Ray Train's record ({e})")
    if interrupted:
        raise RunInterrupted("interrupted")
    if result.error is not None:
        raise RunFailed(f"training failed: {describe_failure(result.error)}") from result.error
    return result


def _watch_sigint(trainer) -> list:
    """Ctrl-C while Ray Train's fit() runs: Ray's own handler aborts the run gracefully and fit()
    then returns as if it had ended. This one does the same and remembers it (the list returned
    is non-empty once interrupted), so the driver reports an interrupted run; a third Ctrl-C
    stops at once."""
    interrupted: list = []
    if not hasattr(trainer, "_register_sigint_handler") or threading.current_thread() is not threading.main_thread():
        return interrupted

    def register(controller):
        def handler(signum, frame):
            interrupted.append(time.time())
            if len(interrupted) >= 3:
                raise KeyboardInterrupt
            if len(interrupted) == 1:
                say("interrupt (Ctrl-C): stopping the workers (Ctrl-C twice more to stop at once)")
                try:
                    controller.abort.remote()
                except Exception:  # noqa: BLE001 - the controller is already gone
                    raise KeyboardInterrupt from None

        signal.signal(signal.SIGINT, handler)

    trainer._register_sigint_handler = register
    return interrupted
