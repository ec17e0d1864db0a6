"""The RL stage (`train.stage: rl`; grpo, rloo, ppo) for the driver: reward model and value-model
checks, the prompt datasets, the reward pool while the policy workers train, and the summary's
`rl` and `reward_pool` sections."""
from __future__ import annotations

import glob
import os

import ray
from omegaconf import DictConfig

from ..data.prompts import build_prompt_dataset, row_columns
from ..driver.stages import StageData, StageSpec
from ..data.precheck import check_data_files
from ..errors import RapidfireError
from ..log import say
from ..models import load_tokenizer
from .reward_pool import check_reward_model, kill_actors, launch_reward_actors, same_vocabulary
from .summary import actor_stats, pool_summary, rl_summary


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


def value_init_of(cfg: DictConfig, reward_path: str | None, matches: bool | None) -> str:
    """ppo's value model start (`rl.ppo.value_init`, `auto` resolved), checked against the reward model."""
    value_init = cfg.rl.ppo.value_init
    if cfg.rl.algorithm != "ppo":
        return value_init
    if value_init == "auto":
        value_init = "reward" if reward_path else "policy"
    if value_init == "reward" and reward_path is None:
        raise RapidfireError("rl.ppo.value_init: 'reward' but no reward model is there to start the value model "
                             "from; set rl.reward.model, or rl.ppo.value_init=policy")
    if value_init == "reward" and not matches:
        raise RapidfireError("rl.ppo.value_init: the reward model's tokenizer differs from the policy's, so its "
                             "weights cannot read the policy's tokens as a value model; set "
                             "rl.ppo.value_init=policy (the pool still scores text with its own tokenizer)")
    return value_init


class RLStage(StageSpec):
    """Policy workers sampling and updating on prompts, scored by the reward pool and rules.
    No mid-run checkpoints: not resumable, and a worker failure ends the run."""

    rows_noun, more_rows = "prompts", "more prompts"
    max_failures = 0  # an RL run keeps no mid-run checkpoints to restart from
    resumable = False
    eval_rows: list = []
    eval_report = None
    actors: list = []

    def check(self) -> None:
        cfg = self.cfg
        if self.resume:
            raise RapidfireError("--resume: an RL run cannot be resumed yet (it keeps no mid-run checkpoints); start "
                                 "it again, under another run.name or after removing the old run folder")
        check_data_files(cfg.data.path, "prompt")  # empty, unreadable, no `prompt` column: before Ray starts
        if cfg.rl.eval_path:
            check_data_files(cfg.rl.eval_path, "prompt", "rl.eval_path")
        policy_tokenizer = load_tokenizer(cfg.model.name)
        self.reward_path = resolve_reward_model(cfg)
        reward_tokenizer = check_reward_model(self.reward_path) if self.reward_path else None
        self.matches = same_vocabulary(reward_tokenizer, policy_tokenizer) if reward_tokenizer is not None else None
        self.value_init = value_init_of(cfg, self.reward_path, self.matches)
        run_dir = self.run_dir
        if glob.glob(os.path.join(run_dir, "checkpoint-*")) or os.path.exists(os.path.join(run_dir, "run_summary.json")):
            raise RapidfireError(f"run.name: '{cfg.run.name}' already has a run in {run_dir}; choose another run.name, "
                                 "or remove that folder to train again (an RL run cannot be resumed; nothing was "
                                 "overwritten)")

    def extra_cpus(self) -> float:
        reward = self.cfg.rl.reward
        return reward.num_actors * reward.cpus_per_actor if self.reward_path else 0

    def build_data(self, num_cpus: int) -> StageData:
        say(f"reading prompts from {self.cfg.data.path} (prompt) with Ray Data")
        ds, report = build_prompt_dataset(self.cfg, self.cfg.data.path, num_cpus=num_cpus)
        return StageData(ds, report, {})

    def build_eval(self, num_cpus: int) -> None:
        cfg = self.cfg
        if cfg.rl.eval_path:
            eds, self.eval_report = build_prompt_dataset(cfg, cfg.rl.eval_path, num_cpus=num_cpus, what="rl.eval_path")
            self.eval_rows = [row_columns(r) for r in eds.take(cfg.rl.eval_max_prompts)]
            say(f"held-out prompts: {len(self.eval_rows)} from {cfg.rl.eval_path}")

    def loop(self):
        from . import rl_loop_per_worker

        return rl_loop_per_worker

    def start(self, board, data: StageData) -> None:
        if self.reward_path:
            self.actors = launch_reward_actors(self.cfg, self.reward_path)
            say(f"reward pool: {len(self.actors)} actor(s) hosting {self.reward_path}"
                + ("" if self.matches else " (its tokenizer differs from the policy's: it scores re-tokenised text)"))

    def loop_config(self, board, data: StageData) -> dict:
        return {"reward_actors": self.actors, "eval_rows": self.eval_rows, "reward_model": self.reward_path,
                "value_init": self.value_init}

    def start_line(self) -> str:
        cfg = self.cfg
        return (f"training: stage rl ({cfg.rl.algorithm}), policy {cfg.model.name}, "
                f"{cfg.scaling.num_workers} worker(s), rewards: "
                f"{', '.join((['model'] if self.reward_path else []) + list(cfg.rl.reward.functions))}")

    def collect(self, board, result, snapshot: dict) -> None:
        reports = {w.rank: w for w in ray.get(board.worker_reports.remote())}
        self.rank0 = rank0 = reports.get(0)
        self.facts = {"rl/eval_before": rank0.eval_before if rank0 else None,
                      "rl/eval_after": rank0.eval_after if rank0 else None}
        self.pools = [reports[r].reward_pool if r in reports else None for r in range(self.cfg.scaling.num_workers)]
        self.actor_stats = actor_stats(self.actors)

    def stop(self) -> None:
        kill_actors(self.actors)

    def add_sections(self, summary: dict, snapshot: dict, data: StageData, model_dir: str | None) -> None:
        steps = snapshot["steps"]
        summary["rl"] = rl_summary(self.cfg, steps, self.facts, self.reward_path, self.matches, self.value_init)
        if self.eval_report is not None:
            summary["rl"]["eval_data"] = self.eval_report.to_dict()
        summary["reward_pool"] = pool_summary(self.cfg, steps, self.pools, self.actor_stats)
        summary["communication"] = {"mode": self.cfg.communication.mode, **(summary["communication"] or {})}
        if self.rank0 is not None:
            summary["nonfinite_skipped_steps"] = self.rank0.skipped_steps
            if (self.rank0.memory or {}).get("lora") is not None:  # model.lora: r, trainable parameters, share
                from ..models.lora import lora_line

                summary["lora"] = self.rank0.memory["lora"]
                say(lora_line(summary["lora"]))

    def done_text(self, summary: dict) -> str:
        rl = summary["rl"]
        return (f"{summary['steps']} {self.cfg.rl.algorithm} steps, mean reward {rl['mean_reward_first']} -> "
                f"{rl['mean_reward_last']}, rollout {rl['rollout_tokens_per_s']} tokens/s"
                + (f", task score {rl['eval']['before']['task_score']} -> {rl['eval']['after']['task_score']} on "
                   "held-out prompts" if rl.get("eval") else ""))
