"""What each stage adds to the driver's common steps (`driver/run.py`): a `StageSpec` per stage.
SFT and reward runs here; the RL one (grpo, rloo, ppo) in `rl/spec.py`."""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import ray
from omegaconf import DictConfig

from ..checkpoints import SHARD_PLAN_FILE
from ..checkpoints.ledger import checkpoint_folders, prepare_resume, resume_folder
from ..config import is_elastic, worker_range
from ..data import preference
from ..data.loader import DynamicBatches
from ..data.prepare import build_sft_dataset, row_lengths
from ..data.sharding import FULL
from ..data.precheck import check_data_files
from ..errors import RapidfireError
from ..log import say
from ..memory import allocator
from ..memory.levels import MemoryOptions
from ..models import load_tokenizer
from ..models.lora import lora_line
from ..ps.driver import ParameterServer
from ..recovery import elastic_line, elastic_summary, final_world_size, recovery_line, recovery_summary
from ..stages import reward_eval
from ..telemetry.control import adjustments_summary, run_control, stop_control
from .cluster import trainer_class, workers_text
from .outputs import memory_check, parameter_server_line, parameter_server_summary


class StageData(NamedTuple):
    ds: Any  # the rows the workers train on (Ray Train's "train" dataset)
    report: Any  # its DataReport
    datasets: dict  # more Ray datasets for Ray Train, by name


class StageSpec:
    """One run's stage: the hooks `driver.run` calls in order. One instance per run; the hooks
    keep what later hooks need on it."""

    rows_noun, more_rows = "rows", "more data"  # the too-few-rows error
    max_failures: int | None = None  # None: scaling.max_failures
    resumable = True  # a failed run continues with --resume (from its last checkpoint)

    def __init__(self, cfg: DictConfig, run_dir: str, resume: bool):
        self.cfg, self.run_dir, self.resume = cfg, run_dir, resume

    def check(self) -> None:
        """Pre-flight, before Ray starts: fail in seconds on what would fail later."""

    def extra_cpus(self) -> float:
        """CPUs of the stage's own actors, counted when an embedded cluster is sized."""
        return 0.0

    def build_data(self, num_cpus: int) -> StageData:
        raise NotImplementedError

    def build_eval(self, num_cpus: int) -> None:
        """Held-out data the driver keeps for the summary (after the row check)."""

    def loop(self):
        """The Ray Train worker entry function."""
        raise NotImplementedError

    def start(self, board, data: StageData) -> None:
        """Before the workers start: the stage's actors (the board exists; `stop` undoes this)."""

    def loop_config(self, board, data: StageData) -> dict:
        """loop_config entries beyond cfg, num_rows and board."""
        return {}

    def fit_options(self, board, data: StageData) -> dict:
        """More fit_workers keywords (control, trainer_class, extra_env, ...)."""
        return {}

    def saved_plan(self) -> dict | None:
        """The shard plan a resumed run reads its data with."""
        return None

    def start_line(self) -> str:
        raise NotImplementedError

    def collect(self, board, result, snapshot: dict) -> None:
        """After training, before the board and actors go: what the summary needs from them."""

    def stop(self) -> None:
        """Stop what `start` started (also after a failure part way)."""

    def num_workers(self, snapshot: dict) -> int:
        return self.cfg.scaling.num_workers

    def add_sections(self, summary: dict, snapshot: dict, data: StageData, model_dir: str | None) -> None:
        """The stage's own summary sections, added to `summary` in place."""

    def done_text(self, summary: dict) -> str:
        """The final line's result part: `done: <this>; model in ...; summary in ...`."""
        raise NotImplementedError


def _check_resume(run_dir: str, resume: bool) -> None:
    has_checkpoint = bool(checkpoint_folders(run_dir))  # damaged ones set aside do not count
    if has_checkpoint and not resume:
        raise RapidfireError(f"run.name: '{os.path.basename(run_dir)}' already has checkpoints in {run_dir}; pass "
                             "--resume to continue it, or choose another run.name (nothing was overwritten)")
    if resume and not has_checkpoint:
        raise RapidfireError(f"--resume: no checkpoint of run '{os.path.basename(run_dir)}' in {run_dir}; check "
                             "run.name and run.output_dir, or start without --resume")


def saved_shard_plan(run_dir: str) -> dict | None:
    """The shard plan saved with the newest checkpoint: a resumed run reads the same shards, so
    the batches it skips are exactly the ones already trained on. The checkpoint resumed from
    first (`ledger.resume_folder`), then the older ones."""
    folders = checkpoint_folders(run_dir)
    start = resume_folder(run_dir)
    limit = folders.get(os.path.basename(start), -1) if start else -1
    for name in sorted((n for n, s in folders.items() if s <= limit), key=folders.get, reverse=True):
        path = os.path.join(run_dir, name, SHARD_PLAN_FILE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    return None


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


class SFTStage(StageSpec):
    """Supervised fine-tuning: token rows, any communication mode, elastic, resumable."""

    ps = control = held_out = None
    lengths = None
    resume_check: dict | None = None  # ledger.prepare_resume's result (a resumed run)

    def check(self) -> None:
        # A missing data path or an unusable model name fails before Ray starts (the tokenizer is
        # small; for smollm2-135m this also builds the converted-model cache the workers load).
        check_data_files(self.cfg.data.path, self.cfg.data.format)
        if self.cfg.data.eval_path is not None:
            check_data_files(self.cfg.data.eval_path, self.cfg.data.format, "data.eval_path")
        load_tokenizer(self.cfg.model.name)
        _check_resume(self.run_dir, self.resume)
        if self.resume:  # the checkpoint to resume from, Ray Train's record made to agree (checkpoints/ledger.py)
            self.resume_check = prepare_resume(self.run_dir, worker_range(self.cfg)[1], say=say)

    def build_data(self, num_cpus: int) -> StageData:
        cfg = self.cfg
        say(f"reading and tokenising {cfg.data.path} ({cfg.data.format}) with Ray Data")
        ds, report = build_sft_dataset(cfg, num_cpus=num_cpus)
        return StageData(ds, report, {FULL: ds} if is_elastic(cfg) else {})

    def build_eval(self, num_cpus: int) -> None:
        self.held_out = reward_eval.held_out_dataset(self.cfg, num_cpus=num_cpus)  # None without data.eval_path
        if self.held_out is not None:
            say(f"held-out {self.held_out[1].describe()}")

    def loop(self):
        from ..worker import train_loop_per_worker

        return train_loop_per_worker

    def start(self, board, data: StageData) -> None:
        cfg = self.cfg
        self.lengths = dynamic_batch_lengths(cfg, data.ds)
        if cfg.communication.mode == "parameter_server":
            self.ps = ParameterServer(cfg, self.run_dir, resume=self.resume)
            say(f"parameter server: {self.ps.num_shards} shard actor(s), codec {cfg.optimizer.params.compression.grad}, "
                f"max_staleness {cfg.communication.ps.max_staleness}")
        self.control = run_control(cfg, board)

    def loop_config(self, board, data: StageData) -> dict:
        ds = data.ds
        sample_rows = preference.sample_rows(ds) if self.cfg.data.format == preference.NAME else \
            [{"input_ids": [int(t) for t in r["input_ids"]],
              "labels": [int(t) if m else -100 for t, m in zip(r["input_ids"], r["loss_mask"])]} for r in ds.take(2)]
        return {"sample_rows": sample_rows, "lengths": self.lengths, "control": self.control,
                "ps_shards": self.ps.handles if self.ps is not None else None}

    def fit_options(self, board, data: StageData) -> dict:
        cfg = self.cfg
        memory = MemoryOptions.from_config(cfg)
        return {"control": self.control, "trainer_class": trainer_class(cfg),
                "extra_env": allocator.worker_env() if memory.defragment else {}}

    def saved_plan(self) -> dict | None:
        return saved_shard_plan(self.run_dir) if self.resume else None

    def start_line(self) -> str:
        return (f"training: stage {self.cfg.train.stage}, model {self.cfg.model.name}, {workers_text(self.cfg)}"
                + (", resuming from the latest checkpoint" if self.resume else ""))

    def collect(self, board, result, snapshot: dict) -> None:
        reports = ray.get(board.worker_reports.remote())
        self.rank0 = next((w for w in reports if w.rank == 0), None)
        self.held = [w.held_bytes for w in reports if w.held_bytes is not None]
        self.memory_model = ray.get(board.memory_model.remote())
        # Said by the driver (a damaged checkpoint found before the start) and/or by rank 0 (after a restart).
        said = [(self.resume_check or {}).get("message"), ray.get(board.checkpoint_fallback.remote())]
        self.checkpoint_fallback = "; then ".join(m for m in said if m) or None
        self.control_info = ray.get(self.control.info.remote())
        self.elastic_starts = ray.get(board.elastic_starts.remote()) if is_elastic(self.cfg) else []
        if self.ps is not None:
            if result.checkpoint is not None:
                self.ps.finalize(result.checkpoint.path)
            self.ps_clients = [w.exchange for w in reports]
            self.ps_shards = self.ps.stats()

    def stop(self) -> None:
        try:
            if self.control is not None:
                stop_control(self.control, self.cfg.run.name)
        finally:
            if self.ps is not None:
                self.ps.stop()

    def num_workers(self, snapshot: dict) -> int:
        return final_world_size(snapshot["steps"], self.cfg)

    def add_sections(self, summary: dict, snapshot: dict, data: StageData, model_dir: str | None) -> None:
        cfg, steps = self.cfg, snapshot["steps"]
        memory = self.rank0.memory if self.rank0 is not None else None
        memory_model = self.memory_model
        summary["communication"] = {"mode": cfg.communication.mode, **(summary["communication"] or {})}
        auto = (self.rank0.exchange or {}).get("auto") if self.rank0 is not None else None
        if auto is not None:  # compression.grad auto: the link/codec measurements and each bucket's codec
            summary["communication"]["auto"] = auto
        if self.ps is not None:
            summary["parameter_server"] = parameter_server_summary(self.ps_shards, self.ps_clients, steps)
            say(parameter_server_line(summary["parameter_server"]))
        summary["adjustments"] = adjustments_summary(self.control_info)
        if self.rank0 is not None:
            summary["nonfinite_skipped_steps"] = self.rank0.skipped_steps
        # Worker failures survived (scaling.max_failures) and what they cost: steps/samples trained twice.
        summary["recovery"] = recovery_summary(steps, self.checkpoint_fallback,
                                               damaged=(self.resume_check or {}).get("damaged"))
        if recovery_line(summary["recovery"]):
            say(recovery_line(summary["recovery"]))
        if is_elastic(cfg):
            summary["elastic"] = elastic_summary(cfg, steps, self.elastic_starts, data.report.rows)
            say(elastic_line(summary["elastic"]))
        if memory is not None:
            summary["memory"] = {**{k: v for k, v in memory.items() if k not in ("description", "held_bytes", "lora")},
                                 "held_bytes_per_worker": self.held, "peak_memory_bytes": summary["peak_memory_bytes"]}
            say(memory["description"])
            if memory.get("lora") is not None:  # model.lora: r, trainable parameters and their share
                summary["lora"] = memory["lora"]
                say(lora_line(memory["lora"]))
        if memory_model is not None:
            summary["memory_model"] = memory_check(memory_model, steps)
            say(f"memory_aware: {memory_model['description']}; estimated peak "
                f"{memory_model['estimated_peak_bytes'] / 2**30:.2f} GiB for the largest batch "
                f"({memory_model['largest_batch']['rows']} x {memory_model['largest_batch']['width']} tokens), "
                f"measured {summary['memory_model']['measured_peak_bytes'] / 2**30:.2f} GiB on rank 0")

    def done_text(self, summary: dict) -> str:
        return f"{summary['steps']} steps, final loss {summary['final_loss']}, {summary['tokens_per_s']} tokens/s"


class RewardStage(SFTStage):
    """A reward model: SFT's run on preference pairs, plus the held-out pairwise evaluation."""

    def add_sections(self, summary: dict, snapshot: dict, data: StageData, model_dir: str | None) -> None:
        super().add_sections(summary, snapshot, data, model_dir)
        summary["reward_eval"] = reward_eval.reward_eval_section(self.cfg, self.held_out, model_dir, snapshot["logs"])

    def done_text(self, summary: dict) -> str:
        line = reward_eval.reward_eval_line(summary["reward_eval"])
        return super().done_text(summary) + (f"; {line}" if line else "")


def spec_for(cfg: DictConfig, run_dir: str, resume: bool) -> StageSpec:
    """The StageSpec of `train.stage` (a pipeline is run stage by stage: driver.run_pipeline)."""
    if cfg.train.stage == "rl":
        from ..rl.spec import RLStage

        return RLStage(cfg, run_dir, resume)
    stages = {"sft": SFTStage, "reward": RewardStage}
    if cfg.train.stage not in stages:
        raise RapidfireError(f"train.stage: {cfg.train.stage!r} is not a single stage (sft, reward, rl); "
                             "a pipeline runs through driver.run_pipeline")
    return stages[cfg.train.stage](cfg, run_dir, resume)
