"""Supervised fine-tuning: TRL's `SFTTrainer` fed by our Ray Data loader."""
from __future__ import annotations

from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from ..memory.precision import Precision
from .base import RayStageMixin


class RaySFTTrainer(RayStageMixin, SFTTrainer):
    pass


def sft_args(cfg: dict, output_dir: str, use_cpu: bool, precision: Precision | None = None,
             deepspeed: dict | None = None) -> SFTConfig:
    """The trainer's arguments. `deepspeed`: a ZeRO config (memory level3); build the arguments
    before the model then, so that transformers builds the model partitioned."""
    t, o = cfg["train"], cfg["optimizer"]["params"]
    every = cfg["checkpoint"]["every_steps"]
    return SFTConfig(
        output_dir=output_dir,
        max_steps=t["max_steps"],
        num_train_epochs=t["epochs"],
        per_device_train_batch_size=t["per_device_batch_size"],
        gradient_accumulation_steps=t["gradient_accumulation_steps"],
        max_grad_norm=t["grad_clip"],
        lr_scheduler_type=t["lr_scheduler"],
        warmup_steps=t["warmup_steps"],
        learning_rate=o["lr"],
        weight_decay=o["weight_decay"],
        adam_beta1=o["betas"][0],
        adam_beta2=o["betas"][1],
        adam_epsilon=o["eps"],
        logging_steps=t["log_every_steps"],
        save_strategy="steps",
        save_steps=every if every > 0 else 10**9,  # the callback also saves the last step
        seed=cfg["run"]["seed"],
        use_cpu=use_cpu,
        # TRL defaults to bf16 and gradient checkpointing; precision and memory options are ours
        # (memory/precision.py, memory/checkpointing.py).
        **(precision.trainer_flags() if precision is not None else {"bf16": False, "fp16": False}),
        activation_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        max_length=cfg["data"]["max_length"],
        # Rows arrive tokenised from Ray Data; our loader skips already-trained batches itself.
        dataset_kwargs={"skip_prepare_dataset": True},
        ignore_data_skip=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        save_only_model=False,
        deepspeed=deepspeed,
    )


def build_sft_trainer(args: SFTConfig, model, tokenizer, loader, sample_rows: list[dict],
                      callbacks: list) -> RaySFTTrainer:
    # TRL inspects one row of `train_dataset` at start-up; the rows it trains on come from `loader`.
    sample = Dataset.from_list(sample_rows)
    trainer = RaySFTTrainer(model=model, args=args, train_dataset=sample,
                            processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # our progress line replaces its per-log prints
    trainer.rf_loader = loader
    return trainer
