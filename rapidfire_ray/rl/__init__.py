"""The RL stage (`train.stage: rl`): GRPO and RLOO on TRL's trainers, classic PPO written here,
and the reward-model actors they share.

- `rules`: built-in rule rewards (`rl.reward.functions`);
- `reward_pool`: the reward-model actors and the client that scores rollouts through them;
- `trl_stage`: GRPO / RLOO trainers on Ray Train workers with the rollout/reward/update timing;
- `ppo_math`, `ppo`: PPO's advantage and loss math, and its rollout/update loop;
- `evaluate`: held-out task score and reward, before and after training;
- `worker`, `driver`: the per-worker loop and the driver side of a run.
"""
from __future__ import annotations


def rl_loop_per_worker(config: dict) -> None:
    """Ray Train's entry on every worker of the rl stage (`worker.rl_loop_per_worker`), imported
    only there: the driver hands Ray this function by reference without loading TRL's trainers."""
    from .worker import rl_loop_per_worker as run

    run(config)
