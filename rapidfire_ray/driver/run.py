"""One run of one stage (sft, reward, rl): config -> Ray -> datasets -> Ray Train -> outputs.
What differs by stage comes from its StageSpec (`driver/stages.py`, `rl/spec.py`)."""
from __future__ import annotations

import os
import time

import ray
from omegaconf import DictConfig, OmegaConf

from ..config import worker_range
from ..data.sharding import ExactSplitDataConfig
from ..errors import RapidfireError
from ..log import say
from ..telemetry.board import RunBoard
from .cluster import connect, fit_workers, on_driver_node
from .outputs import export_final, run_dir_of, summarise, write_outputs
from .stages import spec_for


def run(cfg: DictConfig, *, address: str | None = None, resume: bool = False) -> dict:
    """Train one stage and return its summary (what `run_summary.json` holds)."""
    t_start = time.time()
    run_dir = run_dir_of(cfg)
    stage = spec_for(cfg, run_dir, resume)
    stage.check()
    connect(address, cfg, extra_cpus=stage.extra_cpus())

    num_cpus = max(1, int(ray.available_resources().get("CPU", 1)) - 1)
    data = stage.build_data(num_cpus)
    say(data.report.describe())
    max_workers = worker_range(cfg)[1]
    if data.report.rows < max_workers:
        raise RapidfireError(f"scaling.num_workers: {max_workers} workers but only {data.report.rows} usable "
                             f"{stage.rows_noun}; use fewer workers or {stage.more_rows}")
    stage.build_eval(num_cpus)

    board = RunBoard.options(scheduling_strategy=on_driver_node()).remote()
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
        finally:
            stage.stop()
    finally:
        ray.kill(board)

    model_dir = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as ckpt:
            model_dir = export_final(cfg, ckpt, os.path.join(run_dir, "model"))
    summary = summarise(stage=cfg.train.stage, snapshot=snapshot, num_workers=stage.num_workers(snapshot),
                        model_dir=model_dir, data=data.report.to_dict(), wall_s=time.time() - t_start)
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint is not None else None
    stage.add_sections(summary, snapshot, data, model_dir)
    path = write_outputs(run_dir, summary, snapshot["steps"])
    say(f"done: {stage.done_text(summary)}; model in {model_dir}; summary in {path}")
    return summary
