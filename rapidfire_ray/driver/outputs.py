"""A run's outputs: the final model in Hugging Face format, `run_summary.json` (and the summary
sections every stage shares), `steps.jsonl`. Written under a temporary name and renamed into
place, so a crash never leaves a half-written file and an earlier complete one stays."""
from __future__ import annotations

import os
import shutil
from collections import Counter

from omegaconf import DictConfig

from ..atomic import atomic_write_json, atomic_write_jsonl, publish_dir
from ..telemetry.timing import PHASES

# Training-state files in a transformers checkpoint that are not part of the model.
STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin",
               "shard_plan.json")


def run_dir_of(cfg: DictConfig) -> str:
    return os.path.join(os.path.abspath(cfg.run.output_dir), cfg.run.name)


def write_outputs(run_dir: str, summary: dict, steps: list[dict]) -> str:
    """`steps.jsonl` (every rank's record of every step: phase seconds, samples, tokens) and
    `run_summary.json`; returns the summary's path."""
    atomic_write_jsonl(os.path.join(run_dir, "steps.jsonl"), sorted(steps, key=lambda r: (r["step"], r["rank"])))
    return atomic_write_json(os.path.join(run_dir, "run_summary.json"), summary)


def _not_model(names: list[str]) -> list[str]:
    """Checkpoint entries that are training state: optimizer, scheduler, RNG, our per-rank state,
    DeepSpeed's ZeRO partitions (`global_stepN/`, `latest`, its conversion scripts)."""
    return [n for n in names if n in STATE_FILES or n.startswith(("rng_state", "comm_state_rank", "global_step"))
            or n in ("latest", "zero_to_fp32.py", "zero_to_torch.py")]


def export_model(checkpoint_dir: str, model_dir: str) -> str:
    """Copy the model and tokenizer files of a transformers checkpoint into `model_dir` (under
    ZeRO-3 the checkpoint's model file holds the gathered weights)."""
    tmp = f"{model_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint_dir, tmp, ignore=lambda d, names: _not_model(names) if d == checkpoint_dir else [])
    return publish_dir(tmp, model_dir)


def export_final(cfg: DictConfig, checkpoint_dir: str, model_dir: str) -> str:
    """The run's final model from its last checkpoint; with LoRA (sft, reward) the adapter merged
    into the base weights unless `model.lora.export` is adapter (`models.lora.export_lora`)."""
    if cfg.model.lora is None or cfg.train.stage == "rl":  # (rl: the worker saved the final policy as exported)
        return export_model(checkpoint_dir, model_dir)
    from ..models.lora import export_lora

    return export_lora(checkpoint_dir, model_dir, stage=cfg.train.stage, model_name=cfg.model.name,
                       export=cfg.model.lora.export, copy_model=export_model)


def summarise(*, stage: str, snapshot: dict, num_workers: int, model_dir: str | None, data: dict,
              wall_s: float) -> dict:
    """The run summary, computed from the per-rank step records the workers pushed."""
    steps = snapshot["steps"]
    rank0 = [r for r in steps if r["rank"] == 0]
    step_time = sum(r["phases"]["step"] for r in rank0)
    tokens = sum(r["tokens"] for r in steps)
    padded = sum(r["padded_tokens"] for r in steps)  # tokens the model computed on, padding included
    # Fractions of step time, averaged over ranks: each rank's phase seconds over its step seconds.
    breakdown = {}
    for phase in (*PHASES, "other"):
        per_rank = []
        for rank in {r["rank"] for r in steps}:
            mine = [r["phases"] for r in steps if r["rank"] == rank]
            total = sum(p["step"] for p in mine) or 1e-12
            per_rank.append(sum(p[phase] for p in mine) / total)
        breakdown[phase] = round(sum(per_rank) / len(per_rank), 4) if per_rank else 0.0
    losses = [(log["step"], log["loss"]) for log in snapshot["logs"] if log.get("loss") is not None]
    return {
        "stage": stage,
        "steps": max((r["step"] for r in steps), default=snapshot["plan"].get("start_step", 0)),
        "start_step": snapshot["plan"].get("start_step", 0),
        "total_steps": snapshot["plan"].get("total_steps"),
        "samples": sum(r["samples"] for r in steps),
        "tokens": tokens,
        "tokens_per_s": round(tokens / step_time, 3) if step_time else 0.0,
        "padding_fraction": round(1 - tokens / padded, 4) if padded else 0.0,
        "train_time_s": round(step_time, 3),
        "wall_time_s": round(wall_s, 3),
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "loss_history": [{"step": s, "loss": round(v, 6)} for s, v in losses],
        "time_breakdown": breakdown,
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in steps), default=0),
        "oom_splits": sum(r.get("oom_splits", 0) for r in steps),
        "communication": communication_summary(steps),
        "num_workers": num_workers,
        "model_dir": model_dir,
        "data": data,
    }


def memory_check(report: dict, steps: list[dict]) -> dict:
    """The memory model's estimate (rank 0's largest planned batch, fixed state included) next to
    the memory rank 0 actually used: peak accelerator memory on GPU; on CPU the growth of the
    process's peak resident set since before the model was loaded."""
    peak = max((r["peak_memory_bytes"] for r in steps if r["rank"] == 0), default=0)
    measured = max(0, peak - report["baseline_bytes"]) if peak else 0
    out = {k: v for k, v in report.items() if k != "description"}
    out["measured_peak_bytes"] = measured
    out["estimate_over_measured"] = round(report["estimated_peak_bytes"] / measured, 3) if measured else None
    return out


def communication_summary(steps: list[dict]) -> dict | None:
    """Bytes each worker sent and received per step (mean over steps and ranks, as counted by the
    code that sends them), the compression ratio against a float32 allreduce of the same
    gradients, communication-call latency percentiles (median of the per-step p50s, highest
    per-step p99), the steps skipped for non-finite gradients, and the share of the exchange's
    in-flight time hidden behind compute (1 - exposed communication phase / in flight)."""
    counted = [r for r in steps if "bytes_sent" in r]
    if not counted:
        return None
    timed = [r for r in counted if r.get("comm_in_flight_s")]
    in_flight = sum(r["comm_in_flight_s"] for r in timed)
    exposed = sum(r["phases"]["communication"] for r in timed)
    sent = sum(r["bytes_sent"] for r in counted)
    fp32 = sum(r["bytes_sent"] * r["compression_ratio"] for r in counted)
    p50s = sorted(r["comm_latency_p50_s"] for r in counted if r["comm_calls"])
    return {
        "bytes_sent_per_step": round(sent / len(counted)),
        "bytes_received_per_step": round(sum(r["bytes_received"] for r in counted) / len(counted)),
        "compression_ratio": round(fp32 / sent, 3) if sent else None,
        "comm_latency_p50_s": round(p50s[len(p50s) // 2], 6) if p50s else None,
        "comm_latency_p99_s": round(max(r["comm_latency_p99_s"] for r in counted), 6) if p50s else None,
        "skipped_steps": max(r["skipped_steps"] for r in counted),
        "in_flight_s_per_step": round(in_flight / len(timed), 6) if timed else None,
        "hidden_share": round(max(0.0, 1 - exposed / in_flight), 4) if in_flight else None,
    }


def parameter_server_summary(shards: list[dict], clients: list[dict | None], steps: list[dict]) -> dict:
    """The `parameter_server` section: per-step push and pull latency (p50/p99 over every
    worker's steps, as the worker measured them: encode, send, apply on the shards, reply;
    admission waits are in the pull), bytes each way per step per worker (the delta pulls, not
    the full pulls at start and checkpoints), admission waits, the shards' counts (pushes,
    applied (and by kind: "grad" AdamW steps, "update" rapidfire_adamw updates), duplicates,
    updates lost to shard restarts), updates per second per shard, the most
    workers queued for admission at once, and the staleness histogram over every applied update."""
    from ..exchange.stats import _percentile

    counted = [r for r in steps if r.get("ps_push_s") is not None]
    push = sorted(r["ps_push_s"] for r in counted)
    pull = sorted(r["ps_pull_s"] for r in counted)
    hist: Counter[int] = Counter()
    for st in shards:
        hist.update(st["staleness_hist"])
    per_step = max(1, len(counted))
    workers = [c for c in clients if c is not None]
    return {
        "num_shards": len(shards),
        "push_latency_p50_s": round(_percentile(push, 0.5), 6), "push_latency_p99_s": round(_percentile(push, 0.99), 6),
        "pull_latency_p50_s": round(_percentile(pull, 0.5), 6), "pull_latency_p99_s": round(_percentile(pull, 0.99), 6),
        "bytes_pushed_per_step": round(sum(r["ps_bytes_pushed"] for r in counted) / per_step),
        "bytes_pulled_per_step": round(sum(r["ps_bytes_pulled"] for r in counted) / per_step),
        "admission_wait_s": round(sum(r["ps_wait_s"] for r in counted), 6),
        "pushes": sum(st["pushes"] for st in shards),
        "applied": sum(st["applied"] for st in shards),
        "applied_by_kind": dict(sum((Counter(st.get("applied_by_kind", {})) for st in shards), Counter())),
        "duplicates": sum(st["duplicates"] for st in shards),
        "lost_updates": sum(st["lost_updates"] for st in shards),
        "restarts": sum(st["restarts"] for st in shards),
        "bound_violations": sum(st["bound_violations"] for st in shards),
        "snapshots": sum(st["snapshots"] for st in shards),
        "updates_per_s_per_shard": [round(st["updates_per_s"], 3) for st in shards],
        "queue_depth_max": max((st["queue_depth_max"] for st in shards), default=0),
        "staleness_hist": dict(sorted(hist.items())),
        "staleness_max": max(hist, default=0),
        "torch_process_group": any(c["torch_process_group"] for c in workers),
        "shards": shards,
        "workers": workers,
    }


def parameter_server_line(ps: dict) -> str:
    return (f"parameter server: {ps['applied']} updates applied on {ps['num_shards']} shard(s) "
            f"({ps['pushes']} pushes, {ps['lost_updates']} lost to restarts), staleness max {ps['staleness_max']}, "
            f"push p50 {ps['push_latency_p50_s'] * 1e3:.1f} ms, pull p50 {ps['pull_latency_p50_s'] * 1e3:.1f} ms, "
            f"{ps['bytes_pushed_per_step']:,} B pushed / {ps['bytes_pulled_per_step']:,} B pulled per step")
