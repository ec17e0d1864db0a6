"""GRPO and RLOO on Ray Train workers: TRL's `GRPOTrainer` / `RLOOTrainer` with our prompt shard,
the reward pool as `reward_funcs`, and the rollout/reward/update timing.

Data: each worker's Ray Data shard of prompt rows is materialised as a small HF `Dataset` (the
rows of this rank only; every rank keeps the same number). TRL's `RepeatSampler` needs a
map-style dataset (it repeats each prompt `rl.num_generations` times, and the batch again for
each step of a generation); we run it over the rank's own rows in a plain `DataLoader` instead of
the accelerate-prepared one, which would shard the already sharded rows a second time. Each rank
therefore samples whole groups of completions, and TRL's group normalisation (over rewards
gathered from every rank, then sliced back per rank) sees complete groups.

Rewards: one TRL reward function per source: `reward_model` (the pool's actors) and each rule
function (`answer_match`, ...), weighted by `rl.reward.weights` through TRL's `reward_weights`;
TRL logs each one's mean.

Reference model: with `rl.kl_beta > 0` TRL builds a frozen copy of the policy from the policy's
`name_or_path`; a policy with no directory behind it (`tiny-random`) is saved to the worker's
scratch folder first so TRL can.
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.trainer.utils import RepeatSampler, identity

from ..stages.base import ExchangeSeams, WorkerParts, trainer_args
from .reward_pool import RewardPool, rows_from_columns


class RLTimingMixin(ExchangeSeams):
    """Mix into a TRL online trainer (before it in the bases): times rollout, reward and update
    (`parts.timer`, an RLStepTimer); the gradient exchange and NaN guard through `ExchangeSeams`."""

    rf_completions = 0
    rf_last_loss = None

    def get_train_dataloader(self):
        # The rank's own rows through TRL's sampler (see the module doc), sized for this rank: TRL's
        # own sizes it for the global generation batch, which accelerate would then shard.
        local = self._train_batch_size * self.args.steps_per_generation  # completions per generation, this rank
        sampler = RepeatSampler(data_source=self.train_dataset, mini_repeat_count=self.num_generations,
                                batch_size=local // self.num_generations,
                                repeat_count=self.num_iterations * self.args.steps_per_generation,
                                shuffle=self.shuffle_dataset, seed=self.args.seed)
        return DataLoader(self.train_dataset, batch_size=local, sampler=sampler, collate_fn=identity, num_workers=0)

    def _generate(self, prompts):
        import time

        t0 = time.perf_counter()
        out = super()._generate(prompts)
        self.rf.timer.generate_s += time.perf_counter() - t0
        completion_ids = out[1]
        self.rf.timer.generated_tokens += sum(len(c) for c in completion_ids)
        self.rf_completions += len(completion_ids)
        return out

    def _calculate_rewards(self, *args, **kwargs):
        with self.rf.timer.phase("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        with self.rf.timer.phase("rollout"):  # the reward phase nested in it is not counted twice
            return super()._generate_and_score_completions(inputs)

    def compute_loss(self, model, inputs, *args, **kwargs):
        with self.rf.timer.phase("forward"):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._rf_register(model)
        # training_step = rollout (when due) + reward + forward + backward: the nested phases are
        # timed on their own, backward is what is left.
        with self.rf.timer.phase("backward"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.rf_last_loss = float(loss.detach().float().item())
        return loss


class RayGRPOTrainer(RLTimingMixin, GRPOTrainer):
    pass


class RayRLOOTrainer(RLTimingMixin, RLOOTrainer):
    pass


def reward_functions(pool: RewardPool) -> list:
    """TRL reward functions, one per reward source of the pool, in `pool.names` order."""
    funcs = []
    if pool.actors:
        def reward_model(prompts, completions, **columns):
            return pool.score_model(list(prompts), list(completions))

        funcs.append(reward_model)
    for name in pool.functions:
        def rule(prompts, completions, _name=name, **columns):
            rows = rows_from_columns(len(prompts), columns)
            if not pool.actors and _name == pool.functions[0]:  # rule rewards only: count each pair once
                pool.requested += len(prompts)
                pool.scored += len(prompts)
            return pool.score_rules(_name, list(prompts), list(completions), rows)

        rule.__name__ = name
        funcs.append(rule)
    return funcs


def trl_args(cfg: dict, output_dir: str, use_cpu: bool, weights: list[float]):
    """GRPOConfig or RLOOConfig from our config (the keys both share)."""
    rl = cfg["rl"]
    return trainer_args(
        GRPOConfig if rl["algorithm"] == "grpo" else RLOOConfig, cfg, output_dir, use_cpu,
        logging_steps=1,  # TRL's per-step metrics are read at each step's end (telemetry.TRLStepCallback)
        save_strategy="no",  # the final policy is saved by the worker (rl.worker)
        bf16=cfg["train"]["precision"] == "bf16",
        gradient_checkpointing=False,
        num_generations=rl["num_generations"],
        max_completion_length=rl["max_new_tokens"],
        temperature=rl["temperature"],
        beta=rl["kl_beta"],
        reward_weights=weights,
    )


def policy_source(model, scratch: str) -> None:
    """Make sure `model.config.name_or_path` is a directory TRL can build the reference model from."""
    path = getattr(model.config, "_name_or_path", "") or ""
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return
    from safetensors.torch import save_model

    # Not save_pretrained: under torch.distributed it writes on rank 0 only, and every rank needs it.
    target = os.path.join(scratch, "initial_policy")
    os.makedirs(target, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # TRL picks the class to build from it
    model.config.save_pretrained(target)
    save_model(model, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    model.config._name_or_path = target


def build_trl_trainer(cfg: dict, model, tokenizer, dataset, pool: RewardPool, callback, scratch: str,
                      use_cpu: bool, parts: WorkerParts):
    lora = cfg["model"]["lora"]
    peft_config = None
    if lora is not None:  # TRL adds the adapters; its reference model is then the base (adapters disabled)
        from ..models.lora import CAUSAL_LM, lora_config

        peft_config = lora_config(lora, CAUSAL_LM)
    elif cfg["rl"]["kl_beta"] > 0:
        policy_source(model, scratch)
    tokenizer.padding_side = "left"
    args = trl_args(cfg, scratch, use_cpu, pool.weights)
    cls = RayGRPOTrainer if cfg["rl"]["algorithm"] == "grpo" else RayRLOOTrainer
    trainer = cls(model=model, reward_funcs=reward_functions(pool), args=args, train_dataset=dataset,
                  processing_class=tokenizer, callbacks=[callback], parts=parts, peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)
    callback.trainer = trainer
    return trainer


def unwrap(trainer) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model)
