"""The summary sections of an RL run: `rl` (algorithm, reward curve, step breakdown, rollout
rate, held-out evaluation) and `reward_pool`."""
from __future__ import annotations

import ray
from omegaconf import DictConfig

# An RL step's phases (`rl/telemetry.py` times them on the workers; defined here, where the driver
# reads them without the workers' TRL callbacks).
RL_PHASES = ("rollout", "reward")
UPDATE_PHASES = ("forward", "backward", "optimizer", "communication")


def actor_stats(actors: list) -> list[dict | None]:
    """Each reward actor's own counts (since its last start) and whether Ray restarted it."""
    out: list[dict | None] = []
    for a in actors:
        try:
            out.append(ray.get(a.stats.remote(), timeout=30))
        except Exception:  # noqa: BLE001 - informative only; a dead actor has nothing to say
            out.append(None)
    return out


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
