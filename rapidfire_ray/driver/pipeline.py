"""`train.stage: pipeline`: SFT, then the reward model, then RL, in one job; each stage an
ordinary `driver.run` in `<run.output_dir>/<run.name>/<stage>/`, starting from the previous
stage's model. How stages chain, resume and are summarised: README, "Pipeline"."""
from __future__ import annotations

import json
import os
import time

from omegaconf import DictConfig, OmegaConf

from ..atomic import atomic_write_json
from ..config import load_config, worker_range
from ..errors import RapidfireError
from ..log import say
from ..capacity import check_fits_here
from . import failure
from .cluster import connect
from .run import run

STAGES = ("sft", "reward", "rl")
SUMMARY = "run_summary.json"
PIPELINE_SUMMARY = "pipeline_summary.json"


def pipeline_dir(cfg: DictConfig) -> str:
    return os.path.join(cfg.run.output_dir, cfg.run.name)


def _has(d: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def stage_config(cfg: DictConfig, stage: str, outputs: dict[str, str]) -> DictConfig:
    """The validated config of one stage: the pipeline's config, this stage's keys on top, and
    the previous stages' models where the stage's keys do not name others. `outputs`: stage ->
    its model directory (it may not exist yet when configs are checked up front)."""
    base = OmegaConf.to_container(cfg, resolve=True)
    own = base.pop("pipeline")[stage] or {}
    if not isinstance(own, dict):
        raise RapidfireError(f"pipeline.{stage}: expected a mapping of config sections (e.g. "
                             f"{{train: {{max_steps: 20}}}}), got {type(own).__name__}")
    base["train"]["stage"] = stage
    base["run"] = {**base["run"], "output_dir": pipeline_dir(cfg), "name": stage}
    if stage in ("reward", "rl") and "sft" in outputs and not _has(own, "model.name"):
        base["model"]["name"] = outputs["sft"]
    if stage == "rl" and "reward" in outputs and not _has(own, "rl.reward.model"):
        base["rl"]["reward"]["model"] = outputs["reward"]
    try:
        return load_config(base, _flatten(own))
    except RapidfireError as e:
        raise RapidfireError(f"pipeline.{stage}: {e}") from None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _stage_state(stage_dir: str) -> str:
    """done (its summary exists), partial (an earlier attempt left files), or new."""
    path = os.path.join(stage_dir, SUMMARY)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                status = json.load(f).get("status", "completed")  # summaries before `status`: completed runs
        except (OSError, ValueError, AttributeError):
            status = "completed"  # read again (and reported if broken) when the stage is skipped
        if status == "completed":
            return "done"
        return "partial"  # a failed or interrupted attempt wrote its summary too
    if os.path.isdir(stage_dir) and os.listdir(stage_dir):
        return "partial"
    return "new"


def _has_checkpoint(stage_dir: str) -> bool:
    return os.path.isdir(stage_dir) and any(n.startswith("checkpoint") for n in os.listdir(stage_dir))


def run_pipeline(cfg: DictConfig, *, address: str | None = None, resume: bool = False) -> dict:
    stages = list(cfg.pipeline.stages)
    if not stages or any(s not in STAGES for s in stages) or len(set(stages)) != len(stages):
        raise RapidfireError(f"pipeline.stages: {stages} is not an ordered selection of {list(STAGES)} without "
                             "repeats; e.g. [sft, reward, rl]")
    if [s for s in STAGES if s in stages] != stages:
        raise RapidfireError(f"pipeline.stages: {stages} is out of order; stages run as {list(STAGES)}")
    root = pipeline_dir(cfg)
    planned = {s: os.path.join(root, s, "model") for s in stages}
    # Every stage's config, checked now (models of later stages are the earlier stages' outputs).
    checked = {s: stage_config(cfg, s, {p: planned[p] for p in stages[:stages.index(s)]}) for s in stages}
    # One cluster for every stage: an embedded one is sized for the stage that needs the most CPUs
    # (the RL stage's reward actors too), so Ray Data still gets a CPU in each.
    extra = {s: c.rl.reward.num_actors * c.rl.reward.cpus_per_actor if s == "rl" else 0.0 for s, c in checked.items()}
    for s in stages:
        check_fits_here(checked[s], address=address)
    biggest = max(stages, key=lambda s: worker_range(checked[s])[1] * checked[s].scaling.cpus_per_worker + extra[s])
    connect(address, checked[biggest], extra_cpus=extra[biggest])
    states = {s: _stage_state(os.path.join(root, s)) for s in stages}
    if not resume and any(st != "new" for st in states.values()):
        started = [s for s in stages if states[s] != "new"]
        raise RapidfireError(f"pipeline '{cfg.run.name}' already has output in {root} (stages {', '.join(started)}); "
                             "pass --resume to continue at the first unfinished stage, or choose another run.name "
                             "(nothing was overwritten)")
    t0 = time.time()
    summaries: dict[str, dict] = {}
    outputs: dict[str, str] = {}
    for i, s in enumerate(stages, 1):
        stage_dir = os.path.join(root, s)
        if states[s] == "done":
            with open(os.path.join(stage_dir, SUMMARY), encoding="utf-8") as f:
                summaries[s] = _load_json(f, os.path.join(stage_dir, SUMMARY))
            outputs[s] = summaries[s].get("model_dir") or os.path.join(stage_dir, "model")
            say(f"pipeline stage {i}/{len(stages)} {s}: done earlier ({os.path.join(stage_dir, SUMMARY)}), skipped")
            continue
        stage_cfg = stage_config(cfg, s, outputs)
        stage_resume = False
        if states[s] == "partial":
            if _has_checkpoint(stage_dir) and s != "rl":
                stage_resume = True
            else:
                aside = f"{stage_dir}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(stage_dir, aside)
                say(f"pipeline stage {s}: the interrupted attempt left no checkpoint to continue from; it is kept "
                    f"in {aside} and the stage starts again")
        say(f"pipeline stage {i}/{len(stages)} {s}: model {stage_cfg.model.name}"
            + (f", reward model {stage_cfg.rl.reward.model}" if s == "rl" and stage_cfg.rl.reward.model else "")
            + (", resuming from its latest checkpoint" if stage_resume else ""))
        failure.in_pipeline = True  # a failed stage is continued by the pipeline's own --resume
        try:
            summaries[s] = run(stage_cfg, address=address, resume=stage_resume)
        finally:
            failure.in_pipeline = False
        outputs[s] = summaries[s].get("model_dir") or os.path.join(stage_dir, "model")
    summary = pipeline_summary(cfg, stages, summaries, root, wall_s=time.time() - t0)
    path = atomic_write_json(os.path.join(root, PIPELINE_SUMMARY), summary)
    cmp = summary.get("comparison")
    say("pipeline done" + (f": task score {cmp['sft_model']['task_score']} (SFT) -> {cmp['rl_model']['task_score']} "
                           f"(RL), mean reward {cmp['sft_model']['mean_reward']} -> {cmp['rl_model']['mean_reward']} "
                           f"on {cmp['prompts']} held-out prompts" if cmp else "") + f"; summary in {path}")
    return summary


def _load_json(f, path: str) -> dict:
    import json

    try:
        return json.load(f)
    except ValueError:
        raise RapidfireError(f"{path}: not a valid run summary (remove it to run that stage again)") from None


def pipeline_summary(cfg: DictConfig, stages: list[str], summaries: dict[str, dict], root: str,
                     wall_s: float) -> dict:
    out = {"stage": "pipeline", "run": cfg.run.name, "folder": root, "stages": stages, "wall_s": round(wall_s, 3),
           "results": {}}
    for s in stages:
        sm = summaries[s]
        row = {"summary": os.path.join(root, s, SUMMARY), "model_dir": sm.get("model_dir"), "steps": sm.get("steps"),
               "first_loss": sm.get("first_loss"), "final_loss": sm.get("final_loss"),
               "train_time_s": sm.get("train_time_s")}
        if s == "reward" and sm.get("reward_eval"):
            row["reward_eval"] = {k: sm["reward_eval"].get(k) for k in ("accuracy", "margin_mean", "pairs")}
        if s == "rl" and sm.get("rl"):
            rl = sm["rl"]
            row["rl"] = {k: rl.get(k) for k in ("algorithm", "mean_reward_first", "mean_reward_last",
                                                "rollout_tokens_per_s")}
        out["results"][s] = row
    ev = summaries.get("rl", {}).get("rl", {}).get("eval")
    if ev:
        before, after = ev["before"], ev["after"]
        out["comparison"] = {
            "prompts": after.get("prompts"),
            "sft_model": {k: before.get(k) for k in ("task_score", "mean_reward", "mean_model_reward")},
            "rl_model": {k: after.get(k) for k in ("task_score", "mean_reward", "mean_model_reward")},
            "note": "the RL stage's held-out evaluation (rl.eval_path, greedy decoding): before = its starting "
                    "policy, the SFT model; after = the trained policy",
        }
    return out
