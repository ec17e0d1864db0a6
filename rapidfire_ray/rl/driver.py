"""The driver side of an RL run (`train.stage: rl`): check the reward model, build the prompt
datasets with Ray Data, start the reward pool, run the policy workers under Ray Train, and write
the policy (`model/`), `steps.jsonl` and `run_summary.json` with its `rl` and `reward_pool`
sections."""
from __future__ import annotations

import glob
import os
import time

import ray
from omegaconf import DictConfig, OmegaConf

from ..atomic import atomic_write_json, atomic_write_jsonl
from ..data.prompts import build_prompt_dataset, row_columns
from ..data.sharding import ExactSplitDataConfig
from ..errors import RapidfireError
from ..launcher import connect, fit_workers, run_dir_of, say
from ..models import load_tokenizer
from ..results import export_model, summarise
from ..placement import on_driver_node
from ..telemetry.progress import ProgressBoard
from .reward_pool import check_reward_model, kill_actors, launch_reward_actors, same_vocabulary
from .telemetry import RL_PHASES, UPDATE_PHASES


def resolve_reward_model(cfg: DictConfig) -> str | None:
    """`rl.reward.model` as an absolute directory, or None (none configured, or an optional one
    an earlier stage has not written)."""
    path = cfg.rl.reward.model
    if path is None:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        return path
    if not cfg.rl.reward.model_required:
        say(f"rl.reward.model: '{cfg.rl.reward.model}' does not exist (rl.reward.model_required false): "
            f"rule rewards only ({', '.join(cfg.rl.reward.functions)})")
        if not cfg.rl.reward.functions:
            raise RapidfireError("rl.reward: the optional rl.reward.model is missing and rl.reward.functions is "
                                 "empty, so nothing would score the rollouts; train the reward model first "
                                 "(train.stage reward) or add rl.reward.functions")
        return None
    raise RapidfireError(f"rl.reward.model: '{cfg.rl.reward.model}' does not exist; train a reward model first "
                         "(train.stage reward writes runs/<name>/model), fix the path, or set "
                         "rl.reward.model_required=false to run on rule rewards when it is missing")


def run_rl(cfg: DictConfig, *, address: str | None = None, resume: bool = False) -> dict:
    from .worker import rl_loop_per_worker

    t_start = time.time()
    if resume:
        raise RapidfireError("--resume: an RL run cannot be resumed yet (it keeps no mid-run checkpoints); start "
                             "it again, under another run.name or after removing the old run folder")
    policy_tokenizer = load_tokenizer(cfg.model.name)
    reward_path = resolve_reward_model(cfg)
    reward_tokenizer = check_reward_model(reward_path) if reward_path else None
    matches = same_vocabulary(reward_tokenizer, policy_tokenizer) if reward_tokenizer is not None else None
    value_init = cfg.rl.ppo.value_init
    if cfg.rl.algorithm == "ppo":
        if value_init == "auto":
            value_init = "reward" if reward_path else "policy"
        if value_init == "reward" and reward_path is None:
            raise RapidfireError("rl.ppo.value_init: 'reward' but no reward model is there to start the value model "
                                 "from; set rl.reward.model, or rl.ppo.value_init=policy")
        if value_init == "reward" and not matches:
            raise RapidfireError("rl.ppo.value_init: the reward model's tokenizer differs from the policy's, so its "
                                 "weights cannot read the policy's tokens as a value model; set "
                                 "rl.ppo.value_init=policy (the pool still scores text with its own tokenizer)")
    run_dir = run_dir_of(cfg)
    if glob.glob(os.path.join(run_dir, "checkpoint-*")) or os.path.exists(os.path.join(run_dir, "run_summary.json")):
        raise RapidfireError(f"run.name: '{cfg.run.name}' already has a run in {run_dir}; choose another run.name, or "
                             "remove that folder to train again (an RL run cannot be resumed; nothing was overwritten)")
    # The reward actors' CPUs count when an embedded cluster is sized.
    connect(address, cfg, extra_cpus=cfg.rl.reward.num_actors * cfg.rl.reward.cpus_per_actor if reward_path else 0)

    say(f"reading prompts from {cfg.data.path} (prompt) with Ray Data")
    num_cpus = max(1, int(ray.available_resources().get("CPU", 1)) - 1)
    ds, report = build_prompt_dataset(cfg, cfg.data.path, num_cpus=num_cpus)
    say(report.describe())
    if report.rows < cfg.scaling.num_workers:
        raise RapidfireError(f"scaling.num_workers: {cfg.scaling.num_workers} workers but only {report.rows} usable "
                             "prompts; use fewer workers or more prompts")
    eval_rows, eval_report = [], None
    if cfg.rl.eval_path:
        eds, eval_report = build_prompt_dataset(cfg, cfg.rl.eval_path, num_cpus=num_cpus, what="rl.eval_path")
        eval_rows = [row_columns(r) for r in eds.take(cfg.rl.eval_max_prompts)]
        say(f"held-out prompts: {len(eval_rows)} from {cfg.rl.eval_path}")

    actors = []
    board = ProgressBoard.options(scheduling_strategy=on_driver_node()).remote()
    try:
        if reward_path:
            actors = launch_reward_actors(cfg, reward_path)
            say(f"reward pool: {len(actors)} actor(s) hosting {reward_path}"
                + ("" if matches else " (its tokenizer differs from the policy's: it scores re-tokenised text)"))
        result = fit_workers(
            cfg, rl_loop_per_worker,
            {"cfg": OmegaConf.to_container(cfg, resolve=True), "num_rows": report.rows, "board": board,
             "reward_actors": actors, "eval_rows": eval_rows, "reward_model": reward_path, "value_init": value_init},
            ds=ds, board=board, dataset_config=ExactSplitDataConfig(shard_by_node=cfg.data.shard_by_node, board=board),
            max_failures=0,  # an RL run keeps no mid-run checkpoints to restart from
            start_line=f"training: stage rl ({cfg.rl.algorithm}), policy {cfg.model.name}, "
            f"{cfg.scaling.num_workers} worker(s), rewards: "
            f"{', '.join((['model'] if reward_path else []) + list(cfg.rl.reward.functions))}")
        snapshot = ray.get(board.snapshot.remote())
        facts = {k: ray.get(board.get.remote(k)) for k in ("rl/eval_before", "rl/eval_after")}
        pools = [ray.get(board.get.remote(f"rl/pool/{r}")) for r in range(cfg.scaling.num_workers)]
        actor_stats = _actor_stats(actors)
    finally:
        ray.kill(board)
        kill_actors(actors)

    model_dir = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as ckpt:
            model_dir = export_model(ckpt, os.path.join(run_dir, "model"))
    summary = summarise(stage="rl", snapshot=snapshot, num_workers=cfg.scaling.num_workers, model_dir=model_dir,
                        data=report.to_dict(), wall_s=time.time() - t_start)
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint is not None else None
    summary["rl"] = rl_summary(cfg, snapshot["steps"], facts, reward_path, matches, value_init)
    if eval_report is not None:
        summary["rl"]["eval_data"] = eval_report.to_dict()
    summary["reward_pool"] = pool_summary(cfg, snapshot["steps"], pools, actor_stats)
    atomic_write_jsonl(os.path.join(run_dir, "steps.jsonl"),
                       sorted(snapshot["steps"], key=lambda r: (r["step"], r["rank"])))
    path = atomic_write_json(os.path.join(run_dir, "run_summary.json"), summary)
    rl = summary["rl"]
    say(f"done: {summary['steps']} {cfg.rl.algorithm} steps, mean reward {rl['mean_reward_first']} -> "
        f"{rl['mean_reward_last']}, rollout {rl['rollout_tokens_per_s']} tokens/s"
        + (f", task score {rl['eval']['before']['task_score']} -> {rl['eval']['after']['task_score']} on held-out "
           f"prompts" if rl.get("eval") else "")
        + f"; model in {model_dir}; summary in {path}")
    return summary


def _actor_stats(actors: list) -> list[dict | None]:
    """Each reward actor's own counts (since its last start) and whether Ray restarted it."""
    out: list[dict | None] = []
    for a in actors:
        try:
            out.append(ray.get(a.stats.remote(), timeout=30))
        except Exception:  # noqa: BLE001 - informative only; a dead actor has nothing to say
            out.append(None)
    return out


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 6) if xs else None


def rl_summary(cfg: DictConfig, steps: list[dict], facts: dict, reward_path, matches, value_init) -> dict:
    """The summary's `rl` section: the algorithm, the reward curve (rank 0's records carry the
    values over all ranks), the step breakdown into rollout / reward / update, rollout tokens/s,
    and the held-out evaluation before and after."""
    rank0 = sorted((r for r in steps if r["rank"] == 0), key=lambda r: r["step"])
    history = [{"step": r["step"], **{k: round(v, 6) for k, v in r["rl"].items() if isinstance(v, (int, float))}}
               for r in rank0]
    rewards = [h.get("reward") for h in history if h.get("reward") is not None]
    breakdown: dict[str, float] = {}
    per_step: dict[str, float] = {}
    ranks = sorted({r["rank"] for r in steps})
    for phase in (*RL_PHASES, "update", *UPDATE_PHASES, "data_wait", "other"):
        fractions = []
        for rank in ranks:
            mine = [r["phases"] for r in steps if r["rank"] == rank]
            total = sum(p["step"] for p in mine) or 1e-12
            seconds = sum(sum(p[k] for k in UPDATE_PHASES) if phase == "update" else p.get(phase, 0.0) for p in mine)
            fractions.append(seconds / total)
        breakdown[phase] = round(sum(fractions) / len(fractions), 4) if fractions else 0.0
    for phase in (*RL_PHASES, "update", "step"):
        secs = [sum(r["phases"][k] for k in UPDATE_PHASES) if phase == "update" else r["phases"][phase] for r in rank0]
        per_step[phase] = round(sum(secs) / len(secs), 4) if secs else None
    # Ranks generate at the same time: the run's rate is the sum of each rank's own rate.
    rate = 0.0
    for rank in ranks:
        mine = [r for r in steps if r["rank"] == rank]
        gen_s = sum(r["phases"].get("generate", 0.0) for r in mine)
        rate += sum(r["tokens"] for r in mine) / gen_s if gen_s else 0.0
    out = {
        "algorithm": cfg.rl.algorithm,
        "num_generations": cfg.rl.num_generations,
        "max_new_tokens": cfg.rl.max_new_tokens,
        "kl_beta": cfg.rl.kl_beta,
        "reward_model": reward_path,
        "reward_tokenizer_matches_policy": matches,
        "reward_functions": list(cfg.rl.reward.functions),
        "reward_weights": dict(cfg.rl.reward.weights),
        "mean_reward_first": rewards[0] if rewards else None,
        "mean_reward_last": rewards[-1] if rewards else None,
        "reward_history": history,
        "time_breakdown": breakdown,
        "seconds_per_step": per_step,
        "rollout_tokens_per_s": round(rate, 3),
        "completions": sum(r["samples"] for r in steps),
        "generated_tokens": sum(r["tokens"] for r in steps),
    }
    if cfg.rl.algorithm == "ppo":
        out["value_init"] = value_init
    if facts.get("rl/eval_before") is not None:
        out["eval"] = {"before": facts["rl/eval_before"], "after": facts["rl/eval_after"]}
    return out


def pool_summary(cfg: DictConfig, steps: list[dict], pools: list[dict | None], actor_stats: list) -> dict:
    """The `reward_pool` section: completions generated vs scored (every one must be), batches
    re-submitted after an actor died, and each actor's own counts and whether it was restarted."""
    generated = sum(r["samples"] for r in steps)
    scored = sum(r.get("reward_scored", 0) for r in steps)
    return {
        "num_actors": len(actor_stats),
        "batch_size": cfg.rl.reward.batch_size,
        "generated": generated,
        "scored": scored,
        "unscored": generated - scored,
        "retries": sum(r.get("reward_retries", 0) for r in steps),
        "actors": actor_stats,
        "per_worker": pools,
    }
