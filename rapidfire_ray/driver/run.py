"""One run of one stage (sft, reward, rl): config -> Ray -> datasets -> Ray Train -> outputs.
What differs by stage comes from its StageSpec (`driver/stages.py`, `rl/spec.py`)."""
from __future__ import annotations

import os
import time

import ray
from omegaconf import DictConfig, OmegaConf

from ..atomic import atomic_write_json
from ..capacity import check_fits_here
from ..config import worker_range
from ..data.sharding import ExactSplitDataConfig
from ..errors import RapidfireError, RunFailed
from ..log import say, warn
from ..telemetry.board import RunBoard
from . import failure
from .cluster import connect, fit_workers, on_driver_node
from .outputs import export_final, run_dir_of, summarise, write_outputs
from .stages import spec_for


def run(cfg: DictConfig, *, address: str | None = None, resume: bool = False) -> dict:
    """Train one stage and return its summary (what `run_summary.json` holds)."""
    t_start = time.time()
    check_fits_here(cfg, address=address)  # before anything starts: a run this machine cannot hold
    run_dir = run_dir_of(cfg)
    stage = spec_for(cfg, run_dir, resume)
    stage.check()
    connect(address, cfg, extra_cpus=stage.extra_cpus())

    cpus = int(ray.available_resources().get("CPU", 1))
    num_cpus = max(1, cpus - 1 if cpus > 2 else cpus)  # Ray Data's tokenising tasks
    data = stage.build_data(num_cpus)
    say(data.report.describe())
    max_workers = worker_range(cfg)[1]
    if data.report.rows < max_workers:
        raise RapidfireError(f"scaling.num_workers: {max_workers} workers but only {data.report.rows} usable "
                             f"{stage.rows_noun}; use fewer workers or {stage.more_rows}")
    stage.build_eval(num_cpus)

    board = RunBoard.options(scheduling_strategy=on_driver_node()).remote()
    failed: BaseException | None = None
    snapshot = None
    try:
        try:
            stage.start(board, data)
            loop_config = {"cfg": OmegaConf.to_container(cfg, resolve=True), "num_rows": data.report.rows,
                           "board": board, **stage.loop_config(board, data)}
            result = fit_workers(
                cfg, stage.loop(), loop_config, ds=data.ds, board=board, more_datasets=data.datasets or None,
                dataset_config=ExactSplitDataConfig(shard_by_node=cfg.data.shard_by_node, board=board,
                                                    saved_plan=stage.saved_plan()),
                max_failures=stage.max_failures, start_line=stage.start_line(), **stage.fit_options(board, data))
            snapshot = ray.get(board.snapshot.remote())
            stage.collect(board, result, snapshot)
        except (RunFailed, KeyboardInterrupt) as e:
            failed = e
            snapshot = _last_snapshot(board)  # the step records, before the board goes
        finally:
            stage.stop()
    finally:
        ray.kill(board)
    if failed is not None:
        _end_failed(cfg, stage, failed, snapshot, run_dir, data, t_start)

    model_dir = None
    export_error = None
    if result.checkpoint is not None:
        try:
            with result.checkpoint.as_directory() as ckpt:
                model_dir = export_final(cfg, ckpt, os.path.join(run_dir, "model"))
        except OSError as e:  # disk full, quota, permissions: the checkpoint still holds the model
            export_error = e
    summary = summarise(stage=cfg.train.stage, snapshot=snapshot, num_workers=stage.num_workers(snapshot),
                        model_dir=model_dir, data=data.report.to_dict(), wall_s=time.time() - t_start)
    summary["status"] = "completed"
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint is not None else None
    if export_error is not None:
        _end_export_failed(summary, export_error, snapshot, run_dir)
    stage.add_sections(summary, snapshot, data, model_dir)
    path = write_outputs(run_dir, summary, snapshot["steps"])
    say(f"done: {stage.done_text(summary)}; model in {model_dir}; summary in {path}")
    return summary


def _last_snapshot(board) -> dict | None:
    try:
        return ray.get(board.snapshot.remote(), timeout=30)
    except Exception as e:  # noqa: BLE001 - the board's node is gone: no step records
        warn(f"the run's step records could not be read ({type(e).__name__}); steps.jsonl is not written")
        return None


def _end_failed(cfg: DictConfig, stage, error: BaseException, snapshot: dict | None, run_dir: str, data,
                t_start: float) -> None:
    """A failed or interrupted run: its summary and step records, our lines (what failed, the
    last checkpoint, how to continue), then RunFailed / RunInterrupted for the CLI."""
    interrupted = isinstance(error, (KeyboardInterrupt, failure.RunInterrupted))
    status = "interrupted" if interrupted else "failed"
    steps = _steps_done(snapshot)
    what = f"interrupted at step {steps or 0}" if interrupted else \
        (str(error).removeprefix("training failed: ") or type(error).__name__)
    summary = {"stage": cfg.train.stage}
    if snapshot is not None:
        try:
            summary = summarise(stage=cfg.train.stage, snapshot=snapshot, num_workers=worker_range(cfg)[1],
                                model_dir=None, data=data.report.to_dict(), wall_s=time.time() - t_start)
        except Exception as e:  # noqa: BLE001 - partial records must not hide the failure itself
            warn(f"summary of the partial run incomplete ({type(e).__name__}: {e})")
    summary.update(failure.failure_fields(status, what, run_dir, steps))
    summary["model_dir"] = None
    summary["wall_time_s"] = round(time.time() - t_start, 3)
    path = _write(run_dir, summary, snapshot)
    ckpt, ckpt_step = summary["last_checkpoint"], summary["last_checkpoint_step"]
    if not interrupted:
        warn(f"run failed: {what}")
    if ckpt:
        say(f"last checkpoint: {ckpt} (step {ckpt_step}; {summary['steps_since_checkpoint'] or 0} step(s) trained "
            "since, to be trained again)")
    else:
        say("no checkpoint on disk (checkpoint.every_steps)")
    if path:
        say(f"summary ({status}) in {path}")
    hint = failure.continue_line(getattr(stage, "resumable", True), run_dir, ckpt is not None)
    if interrupted:
        raise failure.RunInterrupted(f"interrupted at step {steps or 0}; {hint}") from None
    raise RunFailed(f"training failed: {what}; {hint}") from (error if isinstance(error, RunFailed) else None)


def _steps_done(snapshot: dict | None) -> int | None:
    if snapshot is None:
        return None
    return max((r["step"] for r in snapshot["steps"]), default=snapshot["plan"].get("start_step", 0))


def _write(run_dir: str, summary: dict, snapshot: dict | None) -> str | None:
    try:
        os.makedirs(run_dir, exist_ok=True)
        if snapshot is None:
            return atomic_write_json(os.path.join(run_dir, "run_summary.json"), summary)
        return write_outputs(run_dir, summary, snapshot["steps"])
    except OSError as e:
        warn(f"run_summary.json could not be written in {run_dir}: {e}")
        return None


def _end_export_failed(summary: dict, error: OSError, snapshot: dict, run_dir: str) -> None:
    """The final model could not be written: the summary says so and what was saved, the run
    ends with RunFailed after saying what to free."""
    what = f"the final model could not be written to {os.path.join(run_dir, 'model')}: {error}"
    summary.update(failure.failure_fields("failed", what, run_dir, summary.get("steps")))
    path = _write(run_dir, summary, snapshot)
    warn(f"run failed: {what}")
    ckpt = summary["last_checkpoint"] or summary.get("checkpoint")
    say(f"trained model kept in the last checkpoint {ckpt}; {failure.free_space_hint(run_dir, ckpt)}"
        + (f"; summary (failed) in {path}" if path else ""))
    raise RunFailed(f"training finished but exporting the model failed ({error.strerror or error}); the trained "
                    f"weights are in {ckpt}; free space, then copy them or run again")
