"""Supervised fine-tuning: TRL's `SFTTrainer` fed by our Ray Data loader."""
from __future__ import annotations

from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from ..memory.precision import Precision
from .base import RayStageMixin, WorkerParts, trainer_args


class RaySFTTrainer(RayStageMixin, SFTTrainer):
    pass


def sft_args(cfg: dict, output_dir: str, use_cpu: bool, precision: Precision | None = None,
             deepspeed: dict | None = None) -> SFTConfig:
    """The trainer's arguments. `deepspeed`: a ZeRO config (memory level3); build the arguments
    before the model then, so that transformers builds the model partitioned."""
    return trainer_args(
        SFTConfig, cfg, output_dir, use_cpu,
        **(precision.trainer_flags() if precision is not None else {}),
        activation_checkpointing=False,
        max_length=cfg["data"]["max_length"],
        dataset_kwargs={"skip_prepare_dataset": True},  # rows arrive tokenised from Ray Data
        deepspeed=deepspeed,
    )


def build_sft_trainer(args: SFTConfig, model, tokenizer, parts: WorkerParts, sample_rows: list[dict],
                      callbacks: list) -> RaySFTTrainer:
    # TRL inspects one row of `train_dataset` at start-up; the rows it trains on come from `loader`.
    sample = Dataset.from_list(sample_rows)
    trainer = RaySFTTrainer(model=model, args=args, train_dataset=sample, parts=parts,
                            processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # our progress line replaces its per-log prints
    return trainer
