"""Reward-model training: TRL's `RewardTrainer` fed by our Ray Data loader with preference pairs
(`data/preference.py`). The held-out evaluation of the exported model is in `reward_eval.py`.

The model is the configured base model under a one-output sequence-classification head
(`models.load_reward_model`). A batch holds the chosen sides then the rejected sides (TRL's
layout); the loss is TRL's pairwise `-log sigmoid(r_chosen - r_rejected)`.
"""
from __future__ import annotations

import torch
from datasets import Dataset
from torch import nn
from transformers.trainer_callback import PrinterCallback
from trl import RewardConfig, RewardTrainer

from ..data.preference import split_pairs
from ..memory.precision import Precision
from .base import RayStageMixin, WorkerParts, trainer_args


class _PairLoss(RewardTrainer):
    """TRL's reward loss and metrics, with two changes our loop needs:
    - ranks may hold different numbers of pairs in a step (dynamic batching, the last batch of an
      epoch), so only scalars are gathered across ranks (TRL gathers the per-row rewards, which
      needs equal shapes);
    - a batch split after an out-of-memory error carries `rf_weight` (its share of the pairs), so
      the pieces' losses add up to the batch's mean loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        weight = inputs.get("rf_weight", 1.0)  # (kept in the piece: an out-of-memory retry reuses it)
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        if "margin" in inputs:
            loss = -nn.functional.logsigmoid(rewards_chosen - rewards_rejected - inputs["margin"]).mean()
        else:
            loss = -nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
        with torch.no_grad():
            rewards = outputs.logits.detach().float()
            gather = self.accelerator.gather_for_metrics
            if mode == "train":
                self._total_train_tokens += int(gather(inputs["attention_mask"].sum()).sum().item())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            stats = torch.stack([(rewards_chosen > rewards_rejected).float().sum(),
                                 (rewards_chosen - rewards_rejected).float().sum(),
                                 rewards.sum(), torch.tensor(float(rewards_chosen.numel()), device=rewards.device)])
            correct, margin, total, pairs = gather(stats[None]).sum(dim=0).tolist()
            self._metrics[mode]["min_reward"].append(gather(rewards.min()[None]).min().item())
            self._metrics[mode]["max_reward"].append(gather(rewards.max()[None]).max().item())
            self._metrics[mode]["mean_reward"].append(total / max(1.0, 2 * pairs))
            self._metrics[mode]["accuracy"].append(correct / max(1.0, pairs))
            self._metrics[mode]["margin"].append(margin / max(1.0, pairs))
        loss = loss * weight
        return (loss, outputs) if return_outputs else loss


class RayRewardTrainer(RayStageMixin, _PairLoss):
    rf_rows_per_sample = 2  # a pair: its chosen and its rejected row

    def _rf_split(self, batch: dict, parts: int) -> list[dict]:
        return split_pairs(batch, parts)


def reward_args(cfg: dict, output_dir: str, use_cpu: bool, precision: Precision | None = None,
                deepspeed: dict | None = None) -> RewardConfig:
    """The trainer's arguments: the run settings every stage shares (`stages.base.trainer_args`)."""
    return trainer_args(
        RewardConfig, cfg, output_dir, use_cpu,
        **(precision.trainer_flags() if precision is not None else {}),
        activation_checkpointing=False,
        max_length=cfg["data"]["max_length"],
        deepspeed=deepspeed,
    )


def build_reward_trainer(args: RewardConfig, model, tokenizer, parts: WorkerParts, sample_rows: list[dict],
                         callbacks: list) -> RayRewardTrainer:
    # TRL inspects `train_dataset` at start-up (already tokenised pairs: it skips its own
    # tokenisation); the pairs it trains on come from `loader`.
    sample = Dataset.from_list(sample_rows)
    trainer = RayRewardTrainer(model=model, args=args, train_dataset=sample, parts=parts, processing_class=tokenizer,
                               callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # our progress line replaces its per-log prints
    return trainer
