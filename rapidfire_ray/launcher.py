"""The driver side of a run: config -> Ray -> datasets -> Ray Train -> outputs.

`run(cfg, ...)` is what `rapidfire train` and `rapidfire_ray.train()` call.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import socket
import time

# Ray Train V2 patches print() in workers; with `datasets` fingerprinting it floods the logs.
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
# An embedded cluster's raylet gives its agents this long to start (Ray's default, about 15 s, is
# too short on a busy small machine: the raylet then aborts and ray.init fails).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")

import ray  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from .data.loader import DATA_DELAY_ENV, DynamicBatches  # noqa: E402
from .data import preference  # noqa: E402
from .data.prepare import build_sft_dataset, row_lengths  # noqa: E402
from .config import is_elastic, worker_range  # noqa: E402
from .data.sharding import FULL, TRAIN, ExactSplitDataConfig  # noqa: E402
from .data.sources import list_data_files  # noqa: E402
from .errors import RapidfireError, RunFailed  # noqa: E402
from . import faults  # noqa: E402
from .memory import allocator  # noqa: E402
from .memory.levels import MemoryOptions  # noqa: E402
from .models import load_tokenizer  # noqa: E402
from .atomic import atomic_write_json, atomic_write_jsonl
from .ps.driver import SHARD_CPUS, ParameterServer  # noqa: E402
from .placement import on_driver_node, wait_for_workers  # noqa: E402
from .recovery import elastic_line, elastic_summary, final_world_size, recovery_line, recovery_summary  # noqa: E402
from .results import (  # noqa: E402
           export_model,
           memory_check,
           parameter_server_line,
           parameter_server_summary,
           summarise,
)
from .stages import reward_eval as reward_stage  # noqa: E402
from .checkpoints import SHARD_PLAN_FILE  # noqa: E402
from .telemetry.progress import ProgressBoard, ProgressPrinter  # noqa: E402
from .telemetry.control import ControlWatcher, adjustments_summary, run_control, stop_control  # noqa: E402

WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def say(msg: str) -> None:
    print(f"[rapidfire] {msg}", flush=True)


def workers_text(cfg: DictConfig) -> str:
    lo, hi = worker_range(cfg)
    return f"{lo} worker(s)" if lo == hi else f"{lo} to {hi} workers (elastic, batch policy {cfg.scaling.elastic.batch})"


def run_dir_of(cfg: DictConfig) -> str:
    return os.path.join(os.path.abspath(cfg.run.output_dir), cfg.run.name)


def _check_resume(run_dir: str, resume: bool) -> None:
    has_checkpoint = bool(glob.glob(os.path.join(run_dir, "checkpoint-*")))
    if has_checkpoint and not resume:
        raise RapidfireError(f"run.name: '{os.path.basename(run_dir)}' already has checkpoints in {run_dir}; pass "
                             "--resume to continue it, or choose another run.name (nothing was overwritten)")
    if resume and not has_checkpoint:
        raise RapidfireError(f"--resume: no checkpoint of run '{os.path.basename(run_dir)}' in {run_dir}; check "
                             "run.name and run.output_dir, or start without --resume")


def saved_shard_plan(run_dir: str) -> dict | None:
    """The shard plan saved with the newest checkpoint: a resumed run reads the same shards, so
    the batches it skips are exactly the ones already trained on."""
    for ckpt in sorted(glob.glob(os.path.join(run_dir, "checkpoint-*")), reverse=True):
        path = os.path.join(ckpt, SHARD_PLAN_FILE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    return None


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


def connect(address: str | None, cfg: DictConfig, extra_cpus: float = 0.0) -> None:
    """Join the cluster at `address`/RAY_ADDRESS (a `ray job submit` job has it set), reuse an
    already connected one, or start an embedded local cluster big enough for the workers and
    `extra_cpus` (the run's actors: the RL reward pool)."""
    if ray.is_initialized():
        return
    from . import log
    log.quiet_libraries()
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _probe(address)
        # No runtime_env here: inside `ray job submit` it would replace the job's (its working_dir);
        # the training workers get WORKER_ENV through RunConfig.worker_runtime_env instead.
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as e:  # ConnectionError, auth errors, bad address formats
            raise RapidfireError(f"--address '{address}': could not connect to a Ray cluster "
                                 f"({str(e).splitlines()[0][:200]}); check the address (ip:port or auto), that the "
                                 "cluster is up, and RAY_AUTH_MODE=token with its token for a token-auth cluster")
        say(f"connected to Ray cluster at {address}")
        return
    need = worker_range(cfg)[1] * cfg.scaling.cpus_per_worker + extra_cpus
    if cfg.communication.mode == "parameter_server":  # the shard actors' share (one shard by default here)
        need += math.ceil(SHARD_CPUS * (cfg.communication.ps.num_shards or 1))
    # One CPU beyond the workers' share, so Ray Data can still run tasks while they train.
    num_cpus = max(os.cpu_count() or 1, math.ceil(need) + 1)
    import logging
    ray.init(num_cpus=num_cpus, runtime_env={"env_vars": {**WORKER_ENV, **log.worker_env()}}, log_to_driver=True,
             logging_level=logging.INFO if log.verbose() else logging.WARNING)
    log.filter_worker_output()
    say(f"started an embedded local Ray cluster ({num_cpus} CPUs)")


def dynamic_batch_lengths(cfg: DictConfig, ds):
    """Row lengths for dynamic batching (None with fixed batches). A token-budget plan is checked
    here, so an impossible one fails before training; a memory-aware plan needs the workers'
    free memory and is made (and checked) on the workers."""
    strategy = cfg.data.dynamic_batch.strategy
    if strategy == "fixed":
        return None
    lengths = row_lengths(ds)
    if strategy == "token_budget":
        batches = DynamicBatches.token_budget(cfg, lengths)
        try:  # every worker count an elastic run may have must have a plan
            steps = {n: len(batches.plan(n)[0]) for n in sorted(set(worker_range(cfg)))}
        except ValueError as e:
            raise RapidfireError(f"data.dynamic_batch: {e}") from None
        per = ", ".join(f"{s} with {n} worker(s)" for n, s in steps.items())
        say(f"token_budget: {batches.description}, batches per worker per epoch: {per}")
    return lengths


def _trainer_class(cfg: DictConfig):
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
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker,
                                                           **cfg.scaling.resources_per_worker},
                                     placement_strategy=cfg.scaling.placement),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=os.path.abspath(cfg.run.output_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.scaling.max_failures if max_failures is None
                                         else max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": {**WORKER_ENV, **faults.worker_env(),
                                             # an injected slow data source (tests, demonstrations)
                                             **({DATA_DELAY_ENV: os.environ[DATA_DELAY_ENV]}
                                                if os.environ.get(DATA_DELAY_ENV) else {}),
                                             "OMP_NUM_THREADS": str(cfg.scaling.cpus_per_worker),
                                             **__import__("rapidfire_ray.log").log.worker_env(),
                                             **({"DS_ACCELERATOR": "cpu"} if not cfg.scaling.use_gpu else {}),
                                             **(extra_env or {})}},
        ),
        datasets={TRAIN: ds, **(more_datasets or {})},
        dataset_config=dataset_config,
    )
    scaling = trainer.scaling_config
    wait_for_workers(scaling._resources_per_worker_not_none, lo, cfg.scaling.placement,
                     cfg.scaling.placement_timeout_s, say)
    say(start_line)
    with ProgressPrinter(board), (ControlWatcher(control) if control is not None else contextlib.nullcontext()):
        try:
            result = trainer.fit()
        except Exception as e:
            raise RunFailed(f"training failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if result.error is not None:
        raise RunFailed(f"training failed: {result.error}")
    return result


def run(cfg: DictConfig, *, address: str | None = None, resume: bool = False) -> dict:

    if cfg.train.stage == "pipeline":  # SFT -> reward -> RL, each stage a run of its own
        from .pipeline import run_pipeline

        return run_pipeline(cfg, address=address, resume=resume)
    if cfg.train.stage == "rl":  # its own driver: prompts, the reward pool, the policy workers
        from .rl.driver import run_rl

        return run_rl(cfg, address=address, resume=resume)

    from .worker import train_loop_per_worker

    t_start = time.time()
    # Fail on a missing data path or an unusable model name before Ray starts (the tokenizer is
    # small; for smollm2-135m this also builds the converted-model cache the workers load).
    list_data_files(cfg.data.path)
    if cfg.data.eval_path is not None:
        list_data_files(cfg.data.eval_path)
    load_tokenizer(cfg.model.name)
    run_dir = run_dir_of(cfg)
    _check_resume(run_dir, resume)
    connect(address, cfg)

    say(f"reading and tokenising {cfg.data.path} ({cfg.data.format}) with Ray Data")
    num_cpus = int(ray.available_resources().get("CPU", 1))
    ds, report = build_sft_dataset(cfg, num_cpus=max(1, num_cpus - 1))
    say(report.describe())
    max_workers = worker_range(cfg)[1]
    if report.rows < max_workers:
        raise RapidfireError(f"scaling.num_workers: {max_workers} workers but only {report.rows} "
                             "usable rows; use fewer workers or more data")
    held_out = reward_stage.held_out_dataset(cfg, num_cpus=max(1, num_cpus - 1))  # None without data.eval_path
    if held_out is not None:
        say(f"held-out {held_out[1].describe()}")

    lengths = dynamic_batch_lengths(cfg, ds)
    memory_options = MemoryOptions.from_config(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True)
    ps = control = None
    board = ProgressBoard.options(scheduling_strategy=on_driver_node()).remote()
    try:
        if cfg.communication.mode == "parameter_server":
            ps = ParameterServer(cfg, run_dir, resume=resume)
            say(f"parameter server: {ps.num_shards} shard actor(s), codec {cfg.optimizer.params.compression.grad}, "
                f"max_staleness {cfg.communication.ps.max_staleness}")
        control = run_control(cfg, board)
        sample_rows = preference.sample_rows(ds) if cfg.data.format == preference.NAME else \
            [{"input_ids": [int(t) for t in r["input_ids"]],
              "labels": [int(t) if m else -100 for t, m in zip(r["input_ids"], r["loss_mask"])]} for r in ds.take(2)]
        result = fit_workers(
            cfg, train_loop_per_worker,
            {"cfg": plain, "num_rows": report.rows, "board": board, "sample_rows": sample_rows, "lengths": lengths,
             "ps_shards": ps.handles if ps is not None else None, "control": control},
            ds=ds, board=board, control=control, trainer_class=_trainer_class(cfg),
            more_datasets={FULL: ds} if is_elastic(cfg) else None,
            dataset_config=ExactSplitDataConfig(shard_by_node=cfg.data.shard_by_node, board=board,
                                                saved_plan=saved_shard_plan(run_dir) if resume else None),
            extra_env={**(allocator.worker_env() if memory_options.defragment else {}),
                       # a CPU worker on a GPU node must not pick DeepSpeed's CUDA side
                       **({"DS_ACCELERATOR": "cpu"} if memory_options.zero_stage and not cfg.scaling.use_gpu else {})},
            start_line=f"training: stage {cfg.train.stage}, model {cfg.model.name}, {workers_text(cfg)}"
            + (", resuming from the latest checkpoint" if resume else ""))
        snapshot = ray.get(board.snapshot.remote())
        memory_model = ray.get(board.get.remote("memory_model"))
        memory = ray.get(board.get.remote("memory"))
        guard = ray.get(board.get.remote("guard"))
        checkpoint_fallback = ray.get(board.get.remote("checkpoint_fallback"))
        control_info = ray.get(control.info.remote())
        held = [h for h in ray.get([board.get.remote(f"held_bytes/{r}") for r in range(max_workers)]) if h is not None]
        attempts = ray.get(board.get.remote("attempts")) or 0
        elastic_starts = [ray.get(board.get.remote(f"elastic/{a}")) for a in range(attempts)] if is_elastic(cfg) else []
        if ps is not None:
            if result.checkpoint is not None:
                ps.finalize(result.checkpoint.path)
            ps_clients = [ray.get(board.get.remote(f"ps_client/{r}")) for r in range(cfg.scaling.num_workers)]
            ps_shards = ps.stats()
    finally:
        if control is not None:
            stop_control(control, cfg.run.name)
        ray.kill(board)
        if ps is not None:
            ps.stop()

    model_dir = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as ckpt:
            model_dir = export_model(ckpt, os.path.join(run_dir, "model"))
    summary = summarise(stage=cfg.train.stage, snapshot=snapshot, num_workers=final_world_size(snapshot["steps"], cfg),
                        model_dir=model_dir, data=report.to_dict(), wall_s=time.time() - t_start)
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint is not None else None
    summary["communication"] = {"mode": cfg.communication.mode, **(summary["communication"] or {})}
    if ps is not None:
        summary["parameter_server"] = parameter_server_summary(ps_shards, ps_clients, snapshot["steps"])
        say(parameter_server_line(summary["parameter_server"]))
    summary["adjustments"] = adjustments_summary(control_info)
    if guard is not None:
        summary["nonfinite_skipped_steps"] = guard["skipped_steps"]
    # Worker failures survived (scaling.max_failures) and what they cost: steps/samples trained twice.
    summary["recovery"] = recovery_summary(snapshot["steps"], checkpoint_fallback)
    if recovery_line(summary["recovery"]):
        say(recovery_line(summary["recovery"]))
    if is_elastic(cfg):
        summary["elastic"] = elastic_summary(cfg, snapshot["steps"], elastic_starts, report.rows)
        say(elastic_line(summary["elastic"]))
    if memory is not None:
        summary["memory"] = {**{k: v for k, v in memory.items() if k not in ("description", "held_bytes")},
                             "held_bytes_per_worker": held, "peak_memory_bytes": summary["peak_memory_bytes"]}
        say(memory["description"])
    if memory_model is not None:
        summary["memory_model"] = memory_check(memory_model, snapshot["steps"])
        say(f"memory_aware: {memory_model['description']}; estimated peak "
            f"{memory_model['estimated_peak_bytes'] / 2**30:.2f} GiB for the largest batch "
            f"({memory_model['largest_batch']['rows']} x {memory_model['largest_batch']['width']} tokens), "
            f"measured {summary['memory_model']['measured_peak_bytes'] / 2**30:.2f} GiB on rank 0")
    reward_line = ""
    if cfg.train.stage == "reward":
        summary["reward_eval"] = reward_stage.reward_eval_section(cfg, held_out, model_dir, snapshot["logs"])
        reward_line = reward_stage.reward_eval_line(summary["reward_eval"])
    # Every rank's record of every step (phase seconds, samples, tokens), for analysis.
    atomic_write_jsonl(os.path.join(run_dir, "steps.jsonl"), sorted(snapshot["steps"],
                                                                     key=lambda r: (r["step"], r["rank"])))
    path = atomic_write_json(os.path.join(run_dir, "run_summary.json"), summary)
    say(f"done: {summary['steps']} steps, final loss {summary['final_loss']}, {summary['tokens_per_s']} tokens/s; "
        + (f"{reward_line}; " if reward_line else "") + f"model in {model_dir}; summary in {path}")
    return summary
